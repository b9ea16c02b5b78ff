"""Per-key rate limits: token buckets in a real Redis, shared by router replicas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tandem.common.client import AsyncGenerationClient, build_request
from tandem.router.auth import ApiKeys
from tandem.router.main import RouterState, run
from tandem.router.rate_limit import RateLimit, RateLimiter
from tests.cluster_util import router_options


def test_two_replicas_draw_from_one_bucket_per_key(redis_url: str, prefix: str) -> None:
    key, other = f"k-{uuid.uuid4().hex}", f"k-{uuid.uuid4().hex}"

    async def scenario() -> list[int | None]:
        limit = RateLimit(rate=2.0, burst=2)
        a, b = RateLimiter(redis_url, limit, prefix), RateLimiter(redis_url, limit, prefix)
        try:
            first = [await a.take(key), await b.take(key), await a.take(key)]
            assert await b.take(other) is None  # another key has a bucket of its own
            await asyncio.sleep(0.6)  # 2 tokens/s: one is back after 0.5 s
            return [*first, await b.take(key)]
        finally:
            await a.aclose()
            await b.aclose()

    allowed, allowed_too, refused, later = asyncio.run(scenario())
    assert allowed is None and allowed_too is None and later is None
    assert refused is not None and 0 < refused <= 500


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="rate limit must be > 0"):
        RateLimit(rate=0, burst=1)
    with pytest.raises(ValueError, match="burst must be >= 1"):
        RateLimit(rate=1, burst=0)


def test_a_router_refuses_calls_over_a_keys_rate_with_a_retry_hint(
    make_checkpoint: Callable[..., Path], redis_url: str
) -> None:
    key = f"sk-{uuid.uuid4().hex}"
    options = router_options(
        make_checkpoint("llama"),
        redis_url,
        "rate",
        api_keys=ApiKeys([key]),
        # A token comes back every 4 s: the three calls below fit in that even on a loaded
        # machine, so the third one finds the bucket empty.
        rate_limit=RateLimit(rate=0.25, burst=2),
    )

    async def call(client: AsyncGenerationClient) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for _ in client.generate(build_request([1, 2, 3]), timeout_s=10):
                pass
        return ended.value

    async def scenario() -> None:
        stop = asyncio.Event()
        started: asyncio.Future[RouterState] = asyncio.get_running_loop().create_future()
        router = asyncio.create_task(run(options, stop, started))
        address = f"127.0.0.1:{(await started).port}"
        try:
            async with AsyncGenerationClient(address, api_key=key) as client:
                codes = [(await call(client)).code() for _ in range(2)]
                assert codes == [grpc.StatusCode.UNAVAILABLE] * 2  # through: no worker here
                over = await call(client)
                assert over.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "rate limit of 0.25 requests/s (burst 2)" in over.details()
                hint = dict(over.trailing_metadata() or ())["retry-after-ms"]
                assert 0 < int(hint) <= 4000
                await asyncio.sleep(int(hint) / 1000 + 0.1)
                assert (await call(client)).code() is grpc.StatusCode.UNAVAILABLE
        finally:
            stop.set()
            await router

    asyncio.run(scenario())
