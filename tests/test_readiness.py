"""Router readiness: NOT_SERVING until it can route and again when it cannot, while
liveness stays SERVING; the rule and the tracker on their own, then a real router on a
real Redis registry, asked through the standard gRPC health service."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.grpc_server import LIVENESS_SERVICE
from tandem.common.registry import (
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerRegistration,
    WorkerRole,
)
from tandem.router.main import RouterOptions, RouterState, run
from tandem.router.readiness import ReadinessRule, ReadinessTracker
from tandem.router.routing.policy import PolicyName

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CAPACITY = WorkerCapacity(num_kv_blocks=64, block_size=16, max_num_seqs=4)


def test_the_rule_names_what_is_missing() -> None:
    rule = ReadinessRule(min_decode_workers=1, min_prefill_workers=1)
    assert rule.unmet(num_prefill=1, num_decode=0) == "0 of 1 decode workers registered"
    assert rule.unmet(num_prefill=0, num_decode=2) == "0 of 1 prefill workers registered"
    assert rule.unmet(num_prefill=1, num_decode=1) is None
    assert ReadinessRule().unmet(num_prefill=0, num_decode=1) is None
    with pytest.raises(ValueError, match="min_decode_workers"):
        ReadinessRule(min_decode_workers=0)


def test_the_tracker_reports_each_transition_once_and_in_order() -> None:
    counts = {WorkerRole.PREFILL: 0, WorkerRole.DECODE: 0}
    reported: list[bool] = []

    async def set_ready(ready: bool) -> None:
        await asyncio.sleep(0)  # a real health update yields to the loop
        reported.append(ready)

    async def scenario() -> None:
        tracker = ReadinessTracker(ReadinessRule(), counts.__getitem__)
        counts[WorkerRole.DECODE] = 1
        tracker.update()  # before attach: remembered, not reported
        await tracker.attach(set_ready)
        for decode in (2, 0, 0, 1):
            counts[WorkerRole.DECODE] = decode
            tracker.update()
        await tracker.settled()

    asyncio.run(scenario())
    assert reported == [True, False, True]


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)).status


async def _until(address: str, status: int, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (now := await _health(address)) != status:
        assert asyncio.get_running_loop().time() < deadline, f"health stayed {now}"
        await asyncio.sleep(0.05)


def test_a_router_is_ready_only_while_it_sees_a_decode_worker(
    make_checkpoint: Callable[..., Path], redis_url: str
) -> None:
    model = f"ready-{uuid.uuid4().hex[:8]}"
    options = RouterOptions(
        model_dir=str(make_checkpoint("llama")),
        model_name=model,
        redis_url=redis_url,
        port=0,
        prefill_policy=PolicyName.ROUND_ROBIN,
        decode_policy=PolicyName.ROUND_ROBIN,
    )

    async def scenario() -> None:
        stop = asyncio.Event()
        started: asyncio.Future[RouterState] = asyncio.get_running_loop().create_future()
        router = asyncio.create_task(run(options, stop, started))
        address = f"127.0.0.1:{(await started).port}"
        try:
            assert await _health(address) == NOT_SERVING  # no worker yet
            assert await _health(address, "tandem.v1.Generation") == NOT_SERVING
            assert await _health(address, LIVENESS_SERVICE) == SERVING
            info = WorkerInfo("decode-a", WorkerRole.DECODE, "127.0.0.1:1", model, CAPACITY)
            async with WorkerRegistration(redis_url) as worker:
                await worker.register(info, WorkerLoad.idle(CAPACITY))
                await _until(address, SERVING)
                assert await _health(address, "tandem.v1.Generation") == SERVING
            await _until(address, NOT_SERVING)  # the worker deregistered on exit
            assert await _health(address, LIVENESS_SERVICE) == SERVING
        finally:
            stop.set()
            await router

    asyncio.run(scenario())
