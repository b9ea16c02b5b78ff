"""API keys on the public service: a real router, real gRPC, keys in call metadata."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.client import AsyncGenerationClient, build_request
from tandem.router.auth import ApiKeys
from tandem.router.main import RouterState, run
from tests.cluster_util import router_options

KEY = "sk-test-" + uuid.uuid4().hex


def test_keys_come_from_flags_files_and_the_environment(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team a\nkey-from-file\n\n")
    keys = ApiKeys.gather(["key-from-flag"], [keyfile], "env-1, env-2")
    assert keys is not None and len(keys) == 4
    assert all(keys.allows(k) for k in ("key-from-flag", "key-from-file", "env-1", "env-2"))
    assert not keys.allows("key-from-fil")
    assert ApiKeys.gather([], [], None) is None  # no key: the service is open
    with pytest.raises(ValueError, match="cannot read API key file"):
        ApiKeys.gather([], [tmp_path / "missing"], None)
    with pytest.raises(ValueError, match="must not be empty"):
        ApiKeys.gather([" "], [], None)


def test_calls_need_a_valid_key_and_probes_do_not(
    make_checkpoint: Callable[..., Path], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    options = router_options(
        make_checkpoint("llama"),
        redis_url,
        "keys",
        api_keys=ApiKeys([KEY, "another-key"]),
    )

    async def status_of(address: str, api_key: str | None) -> grpc.StatusCode:
        async with AsyncGenerationClient(address, api_key=api_key) as client:
            try:
                async for _ in client.generate(build_request([1, 2, 3]), timeout_s=10):
                    pass
            except grpc.aio.AioRpcError as err:
                assert (err.code() is grpc.StatusCode.UNAUTHENTICATED) == (api_key != KEY)
                return err.code()
        return grpc.StatusCode.OK

    async def scenario() -> None:
        stop = asyncio.Event()
        started: asyncio.Future[RouterState] = asyncio.get_running_loop().create_future()
        router = asyncio.create_task(run(options, stop, started))
        address = f"127.0.0.1:{(await started).port}"
        try:
            assert await status_of(address, None) is grpc.StatusCode.UNAUTHENTICATED
            assert await status_of(address, "wrong") is grpc.StatusCode.UNAUTHENTICATED
            # a valid key gets through to routing: no worker here, so UNAVAILABLE
            assert await status_of(address, KEY) is grpc.StatusCode.UNAVAILABLE
            async with AsyncGenerationClient(address) as anonymous:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await anonymous.list_models(timeout_s=5)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <key>" in refused.value.details()
            async with AsyncGenerationClient(address, api_key=KEY) as client:
                assert (await client.list_models(timeout_s=5)).models[0].name == options.model_name
            async with grpc.aio.insecure_channel(address) as channel:  # probes need no key
                check = health_pb2_grpc.HealthStub(channel).Check
                await check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            stop.set()
            await router

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert KEY not in caplog.text
