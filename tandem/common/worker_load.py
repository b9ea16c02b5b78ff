"""A worker's load, from its engine's load snapshot: for the registry and ``GetStatus``."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Protocol

from tandem.common.registry import BUSY_WINDOW_S, WorkerLoad
from tandem.protos import worker_pb2


class EngineLoadLike(Protocol):
    num_kv_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_prefilled: int
    queued_prefill_tokens: int
    num_preemptions: int
    spec_decode: SpecDecodeStatsLike | None
    busy_seconds: float
    lora_adapters: Mapping[str, str]
    lora_running: Mapping[str, int]
    lora_waiting: Mapping[str, int]
    max_loras: int
    lora_resident: tuple[str, ...]


class SpecDecodeStatsLike(Protocol):
    num_verifications: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    num_request_passes: int
    num_pass_tokens: int
    proposer_seconds: float


class BusyMeter:
    """The share of recent time an engine spent stepping, from its cumulative
    ``busy_seconds``: an exponentially decayed average with time constant ``window_s``,
    corrected for its start (the average over the time it has seen, not a ramp up from
    0), so a worker that just started reports what it does, not a fraction of it."""

    def __init__(self, window_s: float = BUSY_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._at: float | None = None
        self._busy = 0.0
        self._average = 0.0  # decayed average, still biased towards its start at 0
        self._weight = 0.0  # how much of the average is measurement: 1 - exp(-seen / window)
        self.fraction = 0.0

    def update(self, busy_seconds: float) -> float:
        now = self._clock()
        if self._at is not None and now > self._at:
            elapsed = now - self._at
            recent = max(0.0, busy_seconds - self._busy) / elapsed
            keep = math.exp(-elapsed / self.window_s)
            self._average = keep * self._average + (1 - keep) * recent
            self._weight = keep * self._weight + (1 - keep)
            self.fraction = self._average / self._weight
        self._at, self._busy = now, busy_seconds
        return self.fraction


def worker_load(load: EngineLoadLike, busy: BusyMeter | None = None) -> WorkerLoad:
    return WorkerLoad(
        free_kv_blocks=load.num_free_blocks,
        num_running_seqs=load.num_running,
        num_waiting_seqs=load.num_waiting + load.num_waiting_for_kv,
        num_queued_prefill_tokens=load.queued_prefill_tokens,
        busy_fraction=busy.update(load.busy_seconds) if busy is not None else 0.0,
        adapters=dict(load.lora_adapters),
        resident_adapters=tuple(load.lora_resident),
        max_loras=load.max_loras,
    )


def worker_status(
    load: EngineLoadLike, worker_id: str, role: str, num_requests: int
) -> worker_pb2.WorkerStatus:
    """``GetStatus``'s answer; the caller adds its role's own counters."""
    status = worker_pb2.WorkerStatus(
        worker_id=worker_id,
        role=role,
        num_kv_blocks=load.num_kv_blocks,
        num_free_kv_blocks=load.num_free_blocks,
        num_cached_kv_blocks=load.num_cached_blocks,
        num_running=load.num_running,
        num_waiting=load.num_waiting + load.num_waiting_for_kv,
        num_preemptions=load.num_preemptions,
        num_requests=num_requests,
        busy_seconds=load.busy_seconds,
    )
    spec = load.spec_decode
    if spec is not None:
        status.spec_decode.CopyFrom(
            worker_pb2.SpecDecodeStatus(
                num_verifications=spec.num_verifications,
                num_draft_tokens=spec.num_draft_tokens,
                num_accepted_tokens=spec.num_accepted_tokens,
                num_emitted_tokens=spec.num_emitted_tokens,
                num_request_passes=spec.num_request_passes,
                num_pass_tokens=spec.num_pass_tokens,
                proposer_seconds=spec.proposer_seconds,
            )
        )
    return status
