"""Faults through a real cluster: a prefill worker killed mid-flight, a decode worker
killed mid-stream, a worker that stops heartbeating, overload. The client always gets
either one unbroken, correct stream or a clear gRPC status."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request, stream_generate
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2
from tests.cluster_util import complete_all, free_port, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER_ARGS = (
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "64",
    "--registry-ttl",
    "2",
    "--heartbeat-interval",
    "0.5",
)
DECODE_ARGS = ("--kv-pull-timeout", "2")


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=512)


@pytest.fixture
def make_cluster(
    model_dir: Path, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., LocalCluster]]:
    started: list[LocalCluster] = []

    def make(
        num_decode: int = 2, router_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()
    ) -> LocalCluster:
        spec = ClusterSpec(
            model_dir=str(model_dir),
            num_decode=num_decode,
            router_port=free_port(),
            redis_url=redis_url,
            model_name=f"faults-{free_port()}",
            worker_args=WORKER_ARGS,
            decode_args=(*DECODE_ARGS, *decode_args),
            router_args=router_args,
            threads_per_worker=1,
            log_dir=tmp_path / "logs",
        )
        cluster = LocalCluster(spec).start()
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        cluster.stop()


def _greedy(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _expected(offline: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in offline.generate(prompts, params)]


def _pid(cluster: LocalCluster, name: str) -> int:
    return cluster.children[name].process.pid


def test_prefill_worker_killed_mid_flight_still_completes(make_cluster, offline):
    cluster = make_cluster(num_decode=1)
    prompts = random_prompts(6, 4096, (60, 120), seed=41)

    async def run() -> list[list[int]]:
        killed = asyncio.Event()

        async def one(client: AsyncGenerationClient, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for response in client.generate(
                build_request(prompt, _greedy(24)), timeout_s=120
            ):
                tokens += response.token_ids
                if tokens and not killed.is_set():
                    killed.set()
                    os.kill(_pid(cluster, "prefill-0"), signal.SIGKILL)
            return tokens

        async with AsyncGenerationClient(cluster.router_address) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    assert asyncio.run(run()) == _expected(offline, prompts, 24)
    # Later requests find no prefill worker (or a dead one) and are prefilled locally.
    later = asyncio.run(complete_all(cluster.router_address, prompts[:2], _greedy(8)))
    assert [r.token_ids for r in later] == _expected(offline, prompts[:2], 8)


def test_decode_worker_killed_mid_stream_continues_elsewhere(make_cluster, offline):
    cluster = make_cluster(num_decode=2)
    prompt = random_prompts(1, 4096, (70, 70), seed=42)[0]
    tokens: list[int] = []
    for response in stream_generate(cluster.router_address, prompt, _greedy(600), timeout_s=120):
        tokens += response.token_ids
        if 10 <= len(tokens) < 10 + len(response.token_ids):
            busy = [n for n in ("decode-0", "decode-1") if worker_status(cluster, n).num_running]
            assert len(busy) == 1
            os.kill(_pid(cluster, busy[0]), signal.SIGKILL)
    assert tokens == _expected(offline, [prompt], 600)[0]


def test_a_stalled_decode_worker_is_left_and_the_stream_continues_elsewhere(make_cluster, offline):
    """SIGSTOP: the worker's connections stay open and nothing arrives; the router's
    stall bound moves the stream, which ends token-identical."""
    cluster = make_cluster(num_decode=2, router_args=("--stall-timeout", "1"))
    prompt = random_prompts(1, 4096, (70, 70), seed=46)[0]
    tokens: list[int] = []
    stopped: list[int] = []
    try:
        for response in stream_generate(
            cluster.router_address, prompt, _greedy(400), timeout_s=120
        ):
            tokens += response.token_ids
            if not stopped and len(tokens) >= 10:
                busy = [
                    n for n in ("decode-0", "decode-1") if worker_status(cluster, n).num_running
                ]
                assert len(busy) == 1
                stopped.append(_pid(cluster, busy[0]))
                os.kill(stopped[0], signal.SIGSTOP)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped, "the stream ended before a worker could be stopped"
    assert tokens == _expected(offline, [prompt], 400)[0]


@pytest.mark.parametrize("drain_timeout", ["60", "0.2"], ids=["drains", "drain-times-out"])
def test_sigterm_to_a_decode_worker_loses_no_stream(make_cluster, offline, drain_timeout):
    """The signal Kubernetes sends on every rollout: the worker leaves the registry, its
    streams either finish there (drains) or move on when the drain runs out; no stream
    hangs, and every one is token-identical."""
    cluster = make_cluster(num_decode=2, decode_args=("--drain-timeout", drain_timeout))
    prompts = random_prompts(8, 4096, (40, 80), seed=45)
    on_decode_0: list[int] = []

    async def run() -> list[list[int]]:
        signalled = asyncio.Event()

        async def one(client: AsyncGenerationClient, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for response in client.generate(
                build_request(prompt, _greedy(300)), timeout_s=90
            ):
                tokens += response.token_ids
                if len(tokens) >= 8 and not signalled.is_set():
                    signalled.set()
                    on_decode_0.append(worker_status(cluster, "decode-0").num_running)
                    os.kill(_pid(cluster, "decode-0"), signal.SIGTERM)
            return tokens

        async with AsyncGenerationClient(cluster.router_address) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    assert asyncio.run(run()) == _expected(offline, prompts, 300)
    assert on_decode_0[0] > 0, "no stream was on the signalled worker"
    assert cluster.children["decode-0"].process.wait(timeout=60) == 0


def test_worker_that_stops_heartbeating_leaves_and_rejoins(make_cluster, offline):
    cluster = make_cluster(num_decode=1)
    pid = _pid(cluster, "decode-0")
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while cluster.model_info().num_decode_workers:
            assert time.monotonic() < deadline, "a frozen worker stayed in the registry"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as err:
            list(stream_generate(cluster.router_address, [11, 12, 13], _greedy(4), timeout_s=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(pid, signal.SIGCONT)
    cluster.wait_for_workers(1, 1, timeout_s=10)
    prompt = random_prompts(1, 4096, (40, 40), seed=43)[0]
    (result,) = asyncio.run(complete_all(cluster.router_address, [prompt], _greedy(8)))
    assert result.token_ids == _expected(offline, [prompt], 8)[0]


def test_router_queue_limit_gives_resource_exhausted(make_cluster):
    cluster = make_cluster(num_decode=1, router_args=("--max-pending-requests", "2"))
    prompt = random_prompts(1, 4096, (40, 40), seed=44)[0]

    async def run() -> list[grpc.StatusCode]:
        async with AsyncGenerationClient(cluster.router_address) as client:

            async def one() -> grpc.StatusCode:
                try:
                    async for _ in client.generate(
                        build_request(prompt, _greedy(64)), timeout_s=120
                    ):
                        pass
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            return list(await asyncio.gather(*(one() for _ in range(6))))

    codes = asyncio.run(run())
    assert codes.count(grpc.StatusCode.OK) >= 2
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
