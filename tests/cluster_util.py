"""Helpers for end-to-end tests against a real local cluster (real processes, sockets,
Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.wire import FINISH_REASON_FROM_PROTO
from tandem.protos import common_pb2, worker_pb2


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_prompt_tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def complete_all(
    address: str,
    prompts: Sequence[Sequence[int] | str],
    sampling: common_pb2.SamplingParams,
    timeout_s: float = 120,
    *,
    api_key: str | None = None,
    root_certificates: bytes | None = None,
) -> list[Completion]:
    """Send every prompt at once and gather the full streams."""
    async with AsyncGenerationClient(address, api_key, root_certificates) as client:
        return list(
            await asyncio.gather(*(_collect(client, p, sampling, timeout_s) for p in prompts))
        )


async def _collect(client, prompt, sampling, timeout_s) -> Completion:
    tokens, text, finish, cached = [], "", None, 0
    async for response in client.generate(build_request(prompt, sampling), timeout_s=timeout_s):
        tokens += response.token_ids
        text += response.text
        if response.finish_reason:
            finish = FINISH_REASON_FROM_PROTO[response.finish_reason]
            cached = response.usage.cached_prompt_tokens
    return Completion(tokens, text, finish, cached)


def greedy(max_tokens: int, **speculative: object) -> common_pb2.SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens, no early stop; ``speculative``: the
    request's ``SpeculativeParams`` fields (none: the worker's default)."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if speculative:
        params.speculative.CopyFrom(common_pb2.SpeculativeParams(**speculative))
    return params


def worker_status(cluster: LocalCluster, name: str) -> worker_pb2.WorkerStatus:
    """``GetStatus`` of worker ``name`` (mTLS when the cluster runs it)."""
    return cluster.worker_status(name)


def held_kv(cluster: LocalCluster) -> tuple[int, int, int, int]:
    """What a one-prefill, one-decode cluster still holds: prefill blocks in use, prefill
    leases, decode requests running, decode blocks in use (all 0 when idle)."""
    p, d = worker_status(cluster, "prefill-0"), worker_status(cluster, "decode-0")
    return (
        p.num_kv_blocks - p.num_free_kv_blocks,
        p.num_leases,
        d.num_running,
        d.num_kv_blocks - d.num_free_kv_blocks,
    )


def cluster_spec(
    model_dir: Path, redis_url: str, log_dir: Path, name: str, **overrides: object
) -> ClusterSpec:
    """A one-thread-per-worker local cluster on the session's Redis, under a registry
    namespace (model name) of its own; ``overrides`` are further ``ClusterSpec`` fields."""
    fields: dict[str, object] = {
        "model_dir": str(model_dir),
        "router_port": free_port(),
        "redis_url": redis_url,
        "model_name": f"{name}-{free_port()}",
        "threads_per_worker": 1,
        "log_dir": log_dir,
    }
    return ClusterSpec(**(fields | overrides))


@contextlib.contextmanager
def cluster_factory(
    model_dir: Path, redis_url: str, log_dir: Path, name: str
) -> Iterator[Callable[..., LocalCluster]]:
    """``make(**ClusterSpec fields)`` starts a ``cluster_spec`` cluster (a fresh registry
    namespace each); every cluster started is stopped on exit."""
    started: list[LocalCluster] = []

    def make(**fields: object) -> LocalCluster:
        cluster = LocalCluster(cluster_spec(model_dir, redis_url, log_dir, name, **fields))
        started.append(cluster)  # stopped on exit even if its start fails midway
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


def router_options(model_dir: Path, redis_url: str, name: str, **overrides: object):
    """An in-process router on a free port, round robin on both pools, under a registry
    namespace (model name) of its own; ``overrides`` are further ``RouterOptions`` fields."""
    import uuid

    from tandem.router.main import RouterOptions
    from tandem.router.routing.policy import PolicyName

    fields: dict[str, object] = {
        "model_dir": str(model_dir),
        "model_name": f"{name}-{uuid.uuid4().hex[:8]}",
        "redis_url": redis_url,
        "port": 0,
        "prefill_policy": PolicyName.ROUND_ROBIN,
        "decode_policy": PolicyName.ROUND_ROBIN,
    }
    return RouterOptions(**(fields | overrides))


SLOW_DECODE_0 = {"decode-0": {"TANDEM_FAULTS": "engine.step:delay=0.02"}}
"""``worker_env`` that makes each of decode-0's steps 20 ms: a TPOT a 5 ms target cannot meet."""


def tpot_breach_planner():
    """A planner config that answers ``SLOW_DECODE_0`` at once: a 5 ms TPOT target, decode
    1-2 replicas, prefill held at 1, no cooldowns, no waiting before a scale-down."""
    from tandem.planner.policy import PlannerConfig, PoolBounds

    return PlannerConfig(
        tpot_p99_s=0.005,
        decode=PoolBounds(1, 2),
        prefill=PoolBounds(1, 1),
        decode_seqs_per_replica=8.0,
        scale_up_cooldown_s=0,
        scale_down_cooldown_s=0,
        down_stable_s=0,
        lead_s=1,
    )
