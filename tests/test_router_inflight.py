"""The router's own in-flight work, merged into the workers' reported load."""

from __future__ import annotations

import math

import pytest

from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.kv_index.index import PrefixMatch
from tandem.router.routing.inflight import InflightLoad, PrefillLedger, predicted_busy
from tandem.router.routing.policy import PolicyName, RoutingRequest, make_policy
from tandem.router.routing.pool_view import ListPool
from tandem.router.routing.prefix_aware import PrefixAwarePolicy, PrefixCost


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(
    worker_id: str,
    queued: int = 0,
    running: int = 0,
    free: int = 100,
    at: float = 0.0,
    role: WorkerRole = WorkerRole.PREFILL,
) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=100, block_size=16, max_num_seqs=8)
    info = WorkerInfo(worker_id, role, f"{worker_id}:1", "m", capacity)
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
    (a,) = inflight.adjust([record("a", running=1, free=90, at=99.0, role=WorkerRole.DECODE)])
    assert a.load.num_running_seqs == 2 and a.load.free_kv_blocks == 50


def test_a_worker_that_left_is_forgotten_and_late_tickets_are_harmless() -> None:
    inflight = InflightLoad(Clock())
    ticket = inflight.begin_prefill("a", 100)
    inflight.forget("a")
    inflight.end(ticket)
    (a,) = inflight.adjust([record("a", queued=5, at=99.0)])
    assert a.load.num_queued_prefill_tokens == 5


def busy_record(worker_id: str, busy: float, at: float) -> WorkerRecord:
    (plain,) = [record(worker_id, at=at)]
    return WorkerRecord(plain.info, WorkerLoad(100, 0, 0, 0, updated_at=at, busy_fraction=busy))


def test_the_ledger_knows_what_was_in_flight_and_for_how_long_at_any_kept_time() -> None:
    ledger = PrefillLedger()
    assert ledger.at(5.0) == (0, 0, 0.0)  # before any work: nothing in flight
    ledger.record(10.0, 300, 1)
    ledger.record(11.0, 500, 2)
    ledger.record(12.0, 0, 0)
    ledger.record(15.0, 100, 1)
    assert ledger.at(9.0) == (0, 0, 0.0)
    assert ledger.at(11.5) == (500, 2, pytest.approx(1.5))
    assert ledger.at(13.0) == (0, 0, pytest.approx(2.0))
    assert ledger.busy_seconds(16.0) == pytest.approx(3.0)  # 10-12 and 15-16
    ledger.forget_before(13.0)
    assert ledger.at(13.0) == (0, 0, pytest.approx(2.0))
    assert ledger.at(11.0) is None  # pruned: unknown, not "nothing"


def test_predicted_busy_follows_the_meter_and_never_drops_below_the_report() -> None:
    # Busy all of the 1 s since reporting 0.2: the 10 s meter moves ~ (1 - 0.2) / 10.
    assert predicted_busy(0.2, 1.0, 1.0, 10.0) == pytest.approx(0.2 + 0.8 * (1 - math.exp(-0.1)))
    assert predicted_busy(0.2, 0.0, 1.0, 10.0) == 0.2  # idle to us: others may have sent work
    assert predicted_busy(0.5, 0.1, 1.0, 10.0) == 0.5  # busy less than it was: keep the report
    assert predicted_busy(0.2, 5.0, 1.0, 10.0) <= 1.0


def test_work_sent_since_a_busy_report_raises_that_workers_busy_share() -> None:
    clock = Clock()
    inflight = InflightLoad(clock)
    ticket = inflight.begin_prefill("hot", 100)  # in flight from 100.0 to 100.5
    clock.now = 100.5
    inflight.end(ticket)
    clock.now = 101.0
    hot, cold = inflight.adjust([busy_record("hot", 0.2, 99.9), busy_record("cold", 0.2, 99.9)])
    expected = predicted_busy(0.2, 0.5, 1.1, inflight.busy_window_s)
    assert hot.load.busy_fraction == pytest.approx(expected) and expected > 0.22
    assert cold.load.busy_fraction == 0.2
    # A report after the work includes it: nothing more is added.
    (reported,) = inflight.adjust([busy_record("hot", 0.25, 100.8)])
    assert reported.load.busy_fraction == 0.25


def test_the_busy_guard_turns_away_a_holder_the_router_kept_busy_since_its_report() -> None:
    """Two holders of a hot prefix and a cold worker. ``a`` reported under the busy
    limit, ``b`` over it. Once the router has kept ``a`` busy for a while, ``a`` is over
    the limit too and loses its credit instead of taking the hot prefix until its next
    report."""
    clock = Clock()
    inflight = InflightLoad(clock)
    policy = PrefixAwarePolicy(PrefixCost(busy_limit=1.1))
    reports = [busy_record("a", 0.20, 99.5), busy_record("b", 0.30, 99.5)]
    reports.append(busy_record("c", 0.10, 99.5))  # mean 0.2: the limit is 0.22
    request = RoutingRequest("r", 80, matched_blocks=PrefixMatch.of({"a": 4, "b": 4}))

    def decide():
        return policy.decide(request, ListPool(inflight.adjust(reports), policy.load_key))

    before = decide()
    assert (before.worker.info.worker_id, before.matched_blocks, before.num_guarded) == ("a", 4, 1)
    ticket = inflight.begin_prefill("a", 16)
    clock.now = 101.0  # busy all of the 1.5 s since its report: 0.2 -> 0.27 > 1.1 x mean
    inflight.end(ticket)
    after = decide()
    assert (after.matched_blocks, after.num_guarded) == (0, 2)


def test_a_report_corrects_the_routers_estimate_of_work_still_in_flight() -> None:
    """The router sent 1,600 tokens it thought uncached; the worker found most of them
    cached and reports 100 queued. Work sent after the report adds to it."""
    clock = Clock()
    inflight = InflightLoad(clock)
    inflight.begin_prefill("a", 1600)
    (before,) = inflight.adjust([record("a", queued=0, at=99.0)])
    assert before.load.num_queued_prefill_tokens == 1600
    clock.now = 100.5
    (reported,) = inflight.adjust([record("a", queued=100, at=100.2)])
    assert reported.load.num_queued_prefill_tokens == 100
    inflight.begin_prefill("a", 50)
    (after,) = inflight.adjust([record("a", queued=100, at=100.2)])
    assert after.load.num_queued_prefill_tokens == 150


def test_a_worker_with_work_in_flight_never_looks_idle() -> None:
    """Two requests in flight at the report, the first partly computed (the report
    counts less of it than the router's estimate). When the first returns, subtracting
    its estimate would put the second's worker at zero: idle to the policies, which
    would pile the next request behind a running prefill."""
    clock = Clock()
    inflight = InflightLoad(clock)
    first = inflight.begin_prefill("a", 2000)
    inflight.begin_prefill("a", 500)
    clock.now = 100.5
    inflight.end(first)
    (a,) = inflight.adjust([record("a", queued=1500, at=100.2)])  # 1,000 + 500 left
    assert a.load.num_queued_prefill_tokens >= 1 and a.load.num_waiting_seqs >= 1
