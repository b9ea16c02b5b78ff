"""A worker's load, from its engine's load snapshot: for the registry and ``GetStatus``."""

from __future__ import annotations

from typing import Protocol

from protos import worker_pb2
from tandem.registry import WorkerLoad


class EngineLoadLike(Protocol):
    num_kv_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    queued_prefill_tokens: int
    num_preemptions: int


def worker_load(load: EngineLoadLike) -> WorkerLoad:
    return WorkerLoad(
        free_kv_blocks=load.num_free_blocks,
        num_running_seqs=load.num_running,
        num_waiting_seqs=load.num_waiting + load.num_waiting_for_kv,
        num_queued_prefill_tokens=load.queued_prefill_tokens,
    )


def worker_status(
    load: EngineLoadLike, worker_id: str, role: str, num_requests: int
) -> worker_pb2.WorkerStatus:
    """``GetStatus``'s answer; the caller adds its role's own counters."""
    return worker_pb2.WorkerStatus(
        worker_id=worker_id,
        role=role,
        num_kv_blocks=load.num_kv_blocks,
        num_free_kv_blocks=load.num_free_blocks,
        num_cached_kv_blocks=load.num_cached_blocks,
        num_running=load.num_running,
        num_waiting=load.num_waiting + load.num_waiting_for_kv,
        num_preemptions=load.num_preemptions,
        num_requests=num_requests,
    )
