"""The router's own in-flight work, merged into the workers' reported load."""

from __future__ import annotations

from router.inflight import InflightLoad
from router.policy import PolicyName, RoutingRequest, make_policy
from tandem.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(worker_id: str, queued: int = 0, running: int = 0, free: int = 100, at: float = 0.0):
    capacity = WorkerCapacity(num_kv_blocks=100, block_size=16, max_num_seqs=8)
    info = WorkerInfo(worker_id, WorkerRole.PREFILL, f"{worker_id}:1", "m", capacity)
    return WorkerRecord(info, WorkerLoad(free, running, 0, queued, updated_at=at))


def test_work_sent_since_the_last_report_counts_at_once() -> None:
    clock = Clock()
    inflight = InflightLoad(clock)
    inflight.begin_prefill("a", 700)
    (a, b) = inflight.adjust([record("a", at=99.0), record("b", at=99.0)])
    assert a.load.num_queued_prefill_tokens == 700 and a.load.num_waiting_seqs == 1
    assert b.load.num_queued_prefill_tokens == 0


def test_a_burst_is_spread_instead_of_piling_on_the_worker_that_reported_idle() -> None:
    inflight = InflightLoad(Clock())
    policy = make_policy(PolicyName.LEAST_LOADED)
    reports = [record("a", at=99.0), record("b", at=99.0), record("c", at=99.0)]
    chosen = []
    for i in range(6):
        choice = policy.select(RoutingRequest(f"r{i}", 500), inflight.adjust(reports))
        inflight.begin_prefill(choice.info.worker_id, 500)
        chosen.append(choice.info.worker_id)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_a_stale_report_is_overridden_and_a_fresh_one_adds_other_routers_work() -> None:
    clock = Clock()
    inflight = InflightLoad(clock)
    ticket = inflight.begin_prefill("a", 300)
    clock.now = 101.0
    inflight.end(ticket)  # finished at 101: a report from 100.5 still shows it queued
    (stale,) = inflight.adjust([record("a", queued=300, at=100.5)])
    assert stale.load.num_queued_prefill_tokens == 0
    (fresh,) = inflight.adjust([record("a", queued=900, at=101.5)])  # others' work
    assert fresh.load.num_queued_prefill_tokens == 900


def test_decode_streams_hold_sequences_and_kv_blocks() -> None:
    inflight = InflightLoad(Clock())
    inflight.begin_decode("a", kv_blocks=30)
    inflight.begin_decode("a", kv_blocks=20)
    (a,) = inflight.adjust([record("a", running=1, free=90, at=99.0)])
    assert a.load.num_running_seqs == 2 and a.load.free_kv_blocks == 50


def test_a_worker_that_left_is_forgotten_and_late_tickets_are_harmless() -> None:
    inflight = InflightLoad(Clock())
    ticket = inflight.begin_prefill("a", 100)
    inflight.forget("a")
    inflight.end(ticket)
    (a,) = inflight.adjust([record("a", queued=5, at=99.0)])
    assert a.load.num_queued_prefill_tokens == 5
