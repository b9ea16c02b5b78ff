"""The registry's view of a worker's load, from an engine's load snapshot."""

from __future__ import annotations

from typing import Protocol

from tandem.registry import WorkerLoad


class EngineLoadLike(Protocol):
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    queued_prefill_tokens: int


def worker_load(load: EngineLoadLike) -> WorkerLoad:
    return WorkerLoad(
        free_kv_blocks=load.num_free_blocks,
        num_running_seqs=load.num_running,
        num_waiting_seqs=load.num_waiting + load.num_waiting_for_kv,
        num_queued_prefill_tokens=load.queued_prefill_tokens,
    )
