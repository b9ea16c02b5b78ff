"""The fleet simulator, small: it drives the real policies and indexer, is
deterministic, and shows prefix-aware routing computing about what an oracle computes
and far less than round robin, with fewer KV blocks pulled."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tandem.bench.prefix_workloads import Shape, WorkloadSpec, generate
from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.fleet import FleetSim, FleetSpec, SimResult
from tandem.bench.sim.run import format_table, format_targets
from tandem.router.routing.prefix_aware import PrefixCost

pytestmark = pytest.mark.timeout(120)

FLEET = FleetSpec(num_prefill=12, num_decode=6, prefill_kv_blocks=2048, warmup_s=2.0)
CAL = Calibration.named("tiny")


def simulate(shape: Shape, router: str, **spec: object) -> SimResult:
    workload = WorkloadSpec(
        shape, rate=400.0, num_requests=3200, num_prefixes=60, num_conversations=120, **spec
    )
    return FleetSim(FleetSpec(**dataclasses.asdict(FLEET)), CAL, router).run(generate(workload))


@pytest.fixture(scope="module")
def shared() -> dict[str, SimResult]:
    return {r: simulate(Shape.SHARED, r) for r in ("round_robin", "prefix_aware", "oracle")}


def test_prefix_aware_computes_about_what_the_oracle_does_and_far_less_than_round_robin(
    shared: dict[str, SimResult],
) -> None:
    pa, oracle, rr = shared["prefix_aware"], shared["oracle"], shared["round_robin"]
    assert pa.computed_tokens <= 1.1 * oracle.computed_tokens
    assert rr.computed_tokens >= 2 * pa.computed_tokens
    assert pa.hit_rate > 0.8
    assert pa.ttft_ms["p50"] < rr.ttft_ms["p50"]
    assert pa.blocks_pulled < rr.blocks_pulled  # decode workers that hold the prefix
    assert pa.index_entries > 0 and rr.index_entries == 0


def test_the_simulation_is_deterministic(shared: dict[str, SimResult]) -> None:
    again = simulate(Shape.SHARED, "prefix_aware")
    first = shared["prefix_aware"]
    assert (again.computed_tokens, again.ttft_ms, again.blocks_pulled) == (
        first.computed_tokens,
        first.ttft_ms,
        first.blocks_pulled,
    )


def test_under_load_a_hot_prefix_spreads_instead_of_piling_up() -> None:
    """Half the traffic shares one prefix, on 8 prefill workers starting cold and then
    about 40% busy: the work stays even (one holder alone would need 4x its share of the
    time) and most requests still hit. With the busy guard on (the default) this is also
    the case where a guard acting on a pool with queues fed on itself: while the first
    busy reports are still out, the cold start's queues look like a pool at rest, every
    spill is a miss, and it stayed at 88% hits and TTFT p50 530 ms (the guard stands
    aside once the pool's mean queue passes the queue guard's slack)."""
    fleet = FleetSpec(num_prefill=8, num_decode=4, prefill_kv_blocks=2048, warmup_s=2.0)
    workload = WorkloadSpec(Shape.SKEWED, rate=1000.0, num_requests=6000, num_prefixes=40, seed=3)
    sim = FleetSim(fleet, CAL, "prefix_aware")
    pa = sim.run(generate(workload))
    busy = sum(w.busy_seconds for w in sim.prefill_workers) / len(sim.prefill_workers)
    assert busy / pa.simulated_s > 0.3  # loaded
    assert pa.ttft_ms["p50"] < 20
    assert pa.work_imbalance <= 1.3
    assert pa.hit_rate > 0.9


def test_the_report_formats(shared: dict[str, SimResult]) -> None:
    table = format_table("shared", shared)
    assert "| prefix_aware |" in table and "vs oracle" in table
    targets = format_targets({("shared", r): res for r, res in shared.items()})
    assert "- [x] shared: prefill tokens vs oracle" in targets


def test_the_guard_flags_reach_the_simulated_router() -> None:
    """``bench/sim/run.py --imbalance-slack``: a cell's prefill cost is the router's. On a
    nearly idle pool the default slack keeps each prefix on few workers; without slack
    the queue guard fires at any queue and spreads them: more copies, more computed (busy
    guard off, to see the queue guard alone)."""
    from tandem.bench.sim.run import Cell, run_cell
    from tandem.router.routing.prefix_aware import PrefixCost

    workload = WorkloadSpec(Shape.SKEWED, rate=200.0, num_requests=1600, num_prefixes=40)
    results = [
        run_cell(
            Cell(
                workload,
                "prefix_aware",
                FLEET,
                "tiny",
                PrefixCost(imbalance_slack=s, busy_slack=None),
            )
        )
        for s in (256.0, 0.0)
    ]
    assert results[1].computed_tokens > 1.1 * results[0].computed_tokens
    assert results[1].index_entries > results[0].index_entries


def test_the_busy_guard_spreads_a_hot_prefix_on_a_lightly_loaded_pool() -> None:
    """Half the traffic on one prefix, a pool mostly idle: the queue guard never fires
    (some holder is always idle), so the holders do most of the work; guarding on the
    workers' reported busy share spreads the prefix and evens the work out. Forty
    simulated seconds: the busy share is a 10 s average."""
    fleet = FleetSpec(num_prefill=12, num_decode=6, prefill_kv_blocks=2048, warmup_s=4.0)
    workload = WorkloadSpec(Shape.SKEWED, rate=150.0, num_requests=6000, num_prefixes=40)
    runs = {
        slack: FleetSim(fleet, CAL, "prefix_aware", prefill_cost=PrefixCost(busy_slack=slack)).run(
            generate(workload)
        )
        for slack in (None, 0.0)
    }
    assert runs[0.0].work_imbalance < runs[None].work_imbalance - 0.1
    assert runs[0.0].queue_imbalance < runs[None].queue_imbalance - 0.1
    assert runs[0.0].hit_rate > 0.9


def test_the_calibration_fit_keeps_every_cost_non_negative() -> None:
    """Exact data comes back exactly; data whose unconstrained fit has a negative
    intercept (a convex curve) gets the best fit with the intercept at 0, which fits
    better than clamping the unconstrained coefficients."""
    import numpy as np

    from tandem.bench.sim.calibrate import nonnegative_least_squares

    rows = [(1.0, n, n * n / 1000) for n in (1, 8, 32, 128, 512, 1000)]
    exact = [1e-3 + 2e-5 * n + 3e-5 * q for _, n, q in rows]
    assert np.allclose(nonnegative_least_squares(rows, exact), (1e-3, 2e-5, 3e-5))
    convex = [2e-5 * n + 4e-5 * q - 5e-4 for _, n, q in rows]
    unconstrained, *_ = np.linalg.lstsq(np.array(rows), np.array(convex), rcond=None)
    assert unconstrained[0] < 0
    fit = nonnegative_least_squares(rows, convex)
    assert fit[0] == 0.0 and min(fit) >= 0.0

    def residual(coef) -> float:
        return float(np.sum((np.array(rows) @ np.array(coef) - np.array(convex)) ** 2))

    assert residual(fit) < residual(np.maximum(unconstrained, 0.0))


def test_the_router_sees_a_simulated_workers_busy_share_as_of_its_last_heartbeat() -> None:
    """As a real worker's registry record, a simulated one's busy share changes only when
    it heartbeats (once a second, staggered), not with every step it takes; the queued
    tokens it reports are always current."""
    fleet = FleetSpec(num_prefill=2, num_decode=2, prefill_kv_blocks=512, warmup_s=0.5)
    sim = FleetSim(fleet, CAL, "prefix_aware")
    reports: list[tuple[float, float]] = []  # (time, busy share the router sees)
    load_changed = sim.load_changed

    def spy(worker) -> None:
        load_changed(worker)
        if worker is sim.prefill_workers[0]:
            record = worker.record()
            reports.append((sim.now, record.load.busy_fraction))

    sim.load_changed = spy  # type: ignore[method-assign]
    workload = WorkloadSpec(Shape.SHARED, rate=100.0, num_requests=400, num_prefixes=8)
    sim.run(generate(workload))
    changes = [t for (_, old), (t, new) in itertools.pairwise(reports) if new != old]
    assert len(reports) > 50 and len(changes) >= 3  # it works, and reports it
    assert len(changes) <= sim.now / fleet.heartbeat_s + 1  # at most once per heartbeat
    assert all(later - earlier >= 0.99 for earlier, later in itertools.pairwise(changes))
