"""The planner simulation (``bench/planner_sim.py``), small: its JSON line, a static fleet
sized for the peak meeting the SLOs, every request finished exactly once under every
policy, replica-hours on a case worked out by hand, traces refused by name, the HPA's
arithmetic, and the simulated ``/metrics`` naming what the real components expose."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tandem.bench import planner_sim
from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.capacity import ReplicaModel
from tandem.bench.sim.elastic import ElasticFleet, FleetConfig, FleetScrape
from tandem.bench.sim.exposition import RouterMetrics, WorkerReading, worker_scrape
from tandem.bench.sim.scalers import hpa_replicas
from tandem.bench.sim.trace import Arrivals, Trace, TraceError
from tandem.common.metrics import ComponentMetrics, RequestMetrics, Scrape
from tandem.common.worker_metrics import WorkerMetrics
from tandem.planner.policy import CapacityModel, PlannerConfig, PoolBounds
from tandem.planner.signals import PoolSignals, Signals, signals

pytestmark = pytest.mark.timeout(60)

FLAT = "t_s,rate_rps,prompt_tokens,output_tokens\n0,6,3000,400\n600,0,3000,400\n"
# Quiet, a 4x step for two minutes, quiet again: the autoscalers grow and drain both
# pools with requests in flight.
BURSTY = (
    "t_s,rate_rps,prompt_tokens,output_tokens\n"
    "0,3,2000,200\n120,12,2000,200\n240,2,2000,200\n600,0,2000,200\n"
)


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def setup_for(path: Path, *flags: str) -> planner_sim.Setup:
    args = planner_sim._parser().parse_args(["--trace", str(path), *flags])
    return planner_sim.make_setup(args, Trace.read(path))


def test_the_last_line_is_json_with_every_policy(tmp_path: Path, capsys) -> None:
    trace = write(tmp_path, BURSTY)
    assert planner_sim.main(["--trace", str(trace)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    doc = json.loads(last)
    assert set(doc["policies"]) == {"planner", "hpa", "static"}
    for figures in doc["policies"].values():
        assert 0 <= figures["slo_attainment"] <= 1
        hours = figures["replica_hours"]
        assert hours["total"] == pytest.approx(hours["prefill"] + hours["decode"], abs=2e-3)
        assert hours["prefill"] > 0 and hours["decode"] > 0
    static = doc["policies"]["static"]["replica_hours"]
    # The static fleet runs the whole trace (10 minutes) at its size.
    setup = setup_for(trace)
    assert static["prefill"] == pytest.approx(setup.static[0] * 600 / 3600, abs=1e-3)
    assert static["decode"] == pytest.approx(setup.static[1] * 600 / 3600, abs=1e-3)


def test_a_static_fleet_sized_for_the_peak_meets_the_slos_on_a_flat_trace(
    tmp_path: Path,
) -> None:
    setup = setup_for(write(tmp_path, FLAT))
    result = planner_sim.run_policy("static", setup)
    assert result.requests > 3000
    assert result.slo_attainment >= 0.99
    assert result.ttft_ms["p99"] < 2000 and result.tpot_ms["p99"] < 50


@pytest.mark.parametrize("policy", planner_sim.POLICIES)
def test_every_arrival_is_finished_exactly_once(tmp_path: Path, policy: str) -> None:
    setup = setup_for(write(tmp_path, BURSTY))
    result = planner_sim.run_policy(policy, setup)
    assert result.requests > 1000
    assert result.finished == result.requests
    assert result.finished_twice == 0
    if policy != "static":  # the pools grew and were drained while requests ran
        assert result.scale_events["prefill"] + result.scale_events["decode"] >= 2


class Scripted:
    """A policy that sets the counts of a schedule: (from time, prefill, decode)."""

    name = "scripted"
    interval_s = 50.0

    def __init__(self, schedule: list[tuple[float, int, int]]) -> None:
        self.schedule = schedule

    def decide(
        self, now: float, scrape: FleetScrape, replicas: Mapping[str, int]
    ) -> Mapping[str, int]:
        _, prefill, decode = [s for s in self.schedule if s[0] <= now][-1]
        return {"prefill": prefill, "decode": decode}


ROUND = Calibration(
    model="round numbers",
    block_size=16,
    bytes_per_block=1,
    prefill_step_s=0.0,
    prefill_token_s=0.01,  # 100 prompt tokens: 1 s
    prefill_context_token_s=0.0,
    decode_step_s=0.1,  # 0.1 s per output token, whatever the batch
    decode_seq_s=0.0,
    decode_kv_token_s=0.0,
    pull_call_s=0.0,
    pull_byte_s=0.0,
    max_num_batched_tokens=1000,
)


def test_replica_hours_count_from_the_ask_to_the_end_of_the_drain() -> None:
    """By hand, over one hour with a 60 s start-up:

    * prefill: the first replica serves all hour (3,600 s); two more are asked for at 0
      and asked away, idle, at 1,800 s (1,800 s each): 2.0 replica-hours;
    * decode: the first replica is drained at 150 s while it decodes the one request
      (arrived at 100 s, prefilled in 1 s, 1,000 more tokens at 0.1 s: done at 201 s), so
      it counts 201 s; one asked for at 2,000 s and asked away at 2,050 s, still starting,
      counts 50 s."""
    config = FleetConfig(ReplicaModel(ROUND), startup_s=60.0, ttft_slo_s=2.0, tpot_slo_s=0.2)
    fleet = ElasticFleet(config, {"prefill": 1, "decode": 1})
    one = Arrivals(np.array([100.0]), np.array([100]), np.array([1001]))
    schedule = [(0, 3, 1), (150, 3, 0), (1800, 1, 0), (2000, 1, 1), (2050, 1, 0)]
    result = fleet.run(one, Scripted(schedule), end_s=3600.0)
    assert result.replica_hours["prefill"] == pytest.approx(2.0)
    assert result.replica_hours["decode"] == pytest.approx((201 + 50) / 3600)
    assert result.finished == 1 and result.slo_met == 1
    assert result.ttft_ms["p50"] == pytest.approx(1000.0)
    assert result.tpot_ms["p50"] == pytest.approx(100.0)
    assert result.peak_replicas == {"prefill": 3, "decode": 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "t_s,rate_rps,prompt_tokens\n0,1,100\n60,0,100\n",
            "missing column 'output_tokens'",
        ),
        (
            "t_s,rate_rps,prompt_tokens,output_tokens\n0,2,100,10\n60,-3,100,10\n120,0,1,1\n",
            "line 3: rate_rps must be >= 0, got -3",
        ),
        (
            "t_s,rate_rps,prompt_tokens,output_tokens\n0,2,100,10\n60,1,100,10\n",
            "the last row closes the trace, so its rate_rps must be 0",
        ),
        (
            "t_s,rate_rps,prompt_tokens,output_tokens\n0,2,100,10\n60,1,x,10\n120,0,1,1\n",
            "line 3: prompt_tokens must be a number",
        ),
    ],
)
def test_a_malformed_trace_is_refused_by_name(
    tmp_path: Path, capsys, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TraceError, match=message):
        Trace.read(path)
    with pytest.raises(SystemExit) as stopped:
        planner_sim.main(["--trace", str(path)])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shipped_traces_load() -> None:
    for path in sorted((planner_sim.HERE / "traces").glob("*.csv")):
        trace = Trace.read(path)
        assert trace.end_s >= 3600 and trace.expected_requests > 0


def test_the_hpa_computes_as_kubernetes_does() -> None:
    # Four ready pods all busy against a 0.7 target: ceil(4 * 1.0 / 0.7) = 6.
    assert hpa_replicas(4, 4, 4.0, 0.7, 0.1) == 6
    # Within the 10% tolerance: no change.
    assert hpa_replicas(4, 4, 4 * 0.75, 0.7, 0.1) == 4
    # Two of six pods still starting count as idle on the way up: 4 / (6 * 0.7) = 0.95.
    assert hpa_replicas(6, 4, 4.0, 0.7, 0.1) == 6
    # ... and as exactly at the target on the way down: (0.4 + 2 * 0.7) / (6 * 0.7).
    assert hpa_replicas(6, 4, 0.4, 0.7, 0.1) == 3


def test_the_simulated_metrics_carry_the_components_own_names() -> None:
    def names(scrape: Scrape) -> set[str]:
        return {s.name for s in scrape.samples}

    router = ComponentMetrics("m", "router")
    RequestMetrics(router)
    load = SimpleNamespace(
        num_kv_blocks=8, num_free_blocks=8, num_cached_blocks=0, num_running=0,
        num_waiting=0, num_waiting_for_kv=0, num_prefilled=0, queued_prefill_tokens=0,
        num_preemptions=0, spec_decode=None, busy_seconds=0.0, lora_adapters={},
        lora_running={}, lora_waiting={}, max_loras=0, lora_resident=(),
    )  # fmt: skip
    worker = WorkerMetrics("m", "prefill", lambda: load)
    real = names(Scrape(router.exposition())) | names(Scrape(worker.exposition()))
    sim = RouterMetrics()
    sim.arrived(10)
    sim.first_token(0.1)
    sim.finished(5, 0.01, 0.2)
    reading = WorkerReading("prefill", 10, 10, 0, 0.1, 1, 0, 0, 0, 0.0)
    assert names(sim.scrape()) | names(worker_scrape(reading)) <= real


# --- what the simulation showed the planner getting wrong, pinned on synthetic intervals ---


def planner_signals(
    *,
    request_rate: float = 0.0,
    mean_output: float | None = None,
    tpot_p99: float | None = None,
    tpot_mean: float | None = None,
    ttft_p99: float | None = None,
    decode: tuple[int, float, float | None] = (1, 0.0, None),
    prefill: tuple[int, float, float] = (1, 0.5, 0.0),
    prompt_rate: float = 0.0,
    prefill_tps: float | None = None,
) -> Signals:
    """``decode``: (replicas, running, output tokens per busy second); ``prefill``:
    (replicas, busy, queued prompt tokens)."""
    d_replicas, running, tokens = decode
    p_replicas, busy, queued = prefill
    return Signals(
        interval_s=10.0, request_rate=request_rate, prompt_token_rate=prompt_rate,
        output_token_rate=0.0, ttft_p50=ttft_p99, ttft_p99=ttft_p99, tpot_p50=tpot_p99,
        tpot_p99=tpot_p99, mean_prompt_tokens=None, mean_output_tokens=mean_output,
        prefill=PoolSignals(p_replicas, 0, 0, queued, busy, prefill_tps, 0.0),
        decode=PoolSignals(d_replicas, running, 0, 0, 1.0, tokens, 0.0),
        tpot_mean=tpot_mean,
    )  # fmt: skip


def test_a_saturated_prefill_pool_is_credited_with_what_it_computed_not_its_queue() -> None:
    def scrape(arrived: int, finished: int, busy_s: float) -> Scrape:
        return worker_scrape(WorkerReading("prefill", arrived, finished, 0, busy_s, 1, 5, 0, 0, 0))

    router = RouterMetrics().scrape()
    before, after = scrape(0, 0, 0.0), scrape(200_000, 100_000, 10.0)  # busy all along
    s = signals(10.0, (router, router), ([before], [after]), ([], []))
    assert s.prefill.tokens_per_busy_second == pytest.approx(10_000)


def test_decode_is_sized_on_what_the_arrivals_need_not_on_an_idle_pool() -> None:
    """Four roomy replicas run 8 sequences fast; the arrivals still need 10 req/s x 400
    tokens x 50 ms = 200 sequences at the target, i.e. two replicas of 100."""
    config = PlannerConfig(tpot_p99_s=0.05, decode=PoolBounds(1, 8), decode_seqs_per_replica=100)
    model = CapacityModel(config)
    s = planner_signals(
        request_rate=10, mean_output=400, tpot_p99=0.003, tpot_mean=0.002, decode=(4, 8, 2700)
    )
    model.observe(s)
    assert model.estimate(s)[1].wanted == 2


def test_decode_capacity_is_learnt_from_a_loaded_pool_only() -> None:
    config = PlannerConfig(tpot_p99_s=0.05, smoothing=1.0)
    model = CapacityModel(config)
    light = planner_signals(tpot_p99=0.004, tpot_mean=0.003, decode=(2, 4, 1300))
    model.observe(light)  # a step's fixed cost dominates: nothing learnt
    assert model.decode_seqs.value is None
    loaded = planner_signals(tpot_p99=0.04, tpot_mean=0.03, decode=(2, 90, 3000))
    model.observe(loaded)  # 3,000 tokens/s held for 50 ms: 150 sequences at the target
    assert model.decode_seqs.value == pytest.approx(150)


def test_a_broken_ttft_asks_for_the_replicas_that_drain_the_queue() -> None:
    """10,000 tokens/s arrive and 60,000 are queued against a 2 s target: (10,000 +
    30,000) / (5,000 x 0.7) = 11.4, so 12 replicas, not one more than the 3 running."""
    config = PlannerConfig(ttft_p99_s=2.0, prefill=PoolBounds(1, 32), smoothing=1.0)
    model = CapacityModel(config)
    s = planner_signals(
        ttft_p99=5.0, prompt_rate=10_000, prefill_tps=5_000, prefill=(3, 1.0, 60_000)
    )
    model.observe(s)
    assert model.estimate(s)[0].wanted == 12
