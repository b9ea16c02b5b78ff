"""The SLO planner: percentiles read from histogram deltas as Prometheus would, the
forecast, the capacity model and the decider's hysteresis on synthetic intervals (a
fake clock: cooldowns are minutes), and the whole loop on a real cluster, where it adds a
decode worker under load it cannot serve within the TPOT target and drains it away again
when the load is gone, with every request answered."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.metrics import Scrape
from tandem.planner.actuators import ClusterActuator, DryRun
from tandem.planner.loop import Endpoints, Planner
from tandem.planner.policy import (
    CapacityModel,
    Decider,
    Estimate,
    Forecast,
    PlannerConfig,
    PoolBounds,
)
from tandem.planner.signals import PoolSignals, Signals, histogram_quantile
from tandem.protos import common_pb2
from tests.cluster_util import SLOW_DECODE_0, cluster_spec, complete_all, tpot_breach_planner
from tests.hf_reference import random_prompts


def histogram_text(counts: dict[str, int]) -> str:
    lines = ["# TYPE tandem:time_to_first_token_seconds histogram"]
    for le, n in counts.items():
        lines.append(f'tandem:time_to_first_token_seconds_bucket{{le="{le}",role="router"}} {n}')
    lines.append(f'tandem:time_to_first_token_seconds_count{{role="router"}} {counts["+Inf"]}')
    return "\n".join(lines) + "\n"


def test_quantiles_come_from_the_observations_between_two_scrapes() -> None:
    before = Scrape(histogram_text({"0.1": 10, "0.5": 10, "1.0": 10, "+Inf": 10}))
    # 100 new observations: 50 in (0.1, 0.5], 50 in (0.5, 1.0].
    after = Scrape(histogram_text({"0.1": 10, "0.5": 60, "1.0": 110, "+Inf": 110}))
    assert histogram_quantile(0.5, before, after, "time_to_first_token_seconds") == 0.5
    p90 = histogram_quantile(0.9, before, after, "time_to_first_token_seconds")
    assert p90 == pytest.approx(0.5 + 0.5 * (40 / 50))
    assert histogram_quantile(0.5, after, after, "time_to_first_token_seconds") is None


def test_the_forecast_looks_ahead_on_a_rise_only() -> None:
    rising, falling = Forecast(0.5), Forecast(0.5)
    for t in range(20):
        rising.observe(10.0 + 2.0 * t, 1.0)
        falling.observe(50.0 - 2.0 * t, 1.0)
    assert rising.trend == pytest.approx(2.0, rel=0.2)
    assert rising.ahead(30) > rising.level + 40
    assert falling.ahead(30) == pytest.approx(falling.level)


def pool(replicas: int, running: float = 0, busy: float = 0.5, tps: float | None = None):
    return PoolSignals(replicas, running, 0, 0, busy, tps, 0.1)


def interval(
    prompt_rate: float = 0.0,
    decode_running: float = 0,
    tpot: float | None = None,
    ttft: float | None = None,
    prefill_tps: float | None = None,
    replicas: tuple[int, int] = (1, 1),
) -> Signals:
    busy = min(1.0, prompt_rate / (prefill_tps * replicas[0])) if prefill_tps else 0.0
    return Signals(
        10.0, prompt_rate / 100, prompt_rate, 0.0, ttft, ttft, tpot, tpot, 100.0, 50.0,
        pool(replicas[0], busy=busy, tps=prefill_tps), pool(replicas[1], running=decode_running),
    )  # fmt: skip


def test_prefill_is_sized_by_prompt_tokens_against_measured_throughput() -> None:
    config = PlannerConfig(target_busy=0.7, prefill=PoolBounds(1, 16), smoothing=1.0)
    model = CapacityModel(config)
    s = interval(prompt_rate=10_000, prefill_tps=5_000, replicas=(2, 1))
    model.observe(s)
    prefill, _ = model.estimate(s)
    assert prefill.capacity_per_replica == 5_000
    assert prefill.wanted == math.ceil(10_000 / (5_000 * 0.7)) == 3


def test_decode_is_sized_by_sequences_at_the_tpot_target() -> None:
    config = PlannerConfig(tpot_p99_s=0.05, decode=PoolBounds(1, 16), smoothing=1.0)
    model = CapacityModel(config)
    # 2 replicas run 40 sequences at 0.04 s per token: 20 each, 25 at the target.
    s = interval(decode_running=40, tpot=0.04, replicas=(1, 2))
    model.observe(s)
    _, decode = model.estimate(s)
    assert decode.capacity_per_replica == pytest.approx(25.0)
    assert decode.wanted == 2
    # Twice the sequences, tokens twice as slow: 80 sequences need 4 replicas of 25.
    s = interval(decode_running=80, tpot=0.08, replicas=(1, 2))
    model = CapacityModel(config)
    model.observe(s)
    assert model.estimate(s)[1].wanted == 4


def test_a_broken_slo_adds_a_replica_before_anything_is_calibrated() -> None:
    model = CapacityModel(PlannerConfig(tpot_p99_s=0.05))
    s = interval(decode_running=0.5, tpot=0.2, replicas=(1, 1))  # nothing to calibrate on
    model.observe(s)
    _, decode = model.estimate(s)
    assert decode.slo_broken and decode.wanted == 2


def test_an_idle_pool_shrinks_even_before_anything_is_calibrated() -> None:
    """A decode pool grown on a broken SLO alone (no capacity measured) must come back to
    its minimum once the load is gone, and keeps its size while there is load."""
    config = PlannerConfig(decode=PoolBounds(1, 4), prefill=PoolBounds(1, 4))
    model = CapacityModel(config)
    busy = interval(decode_running=0.5, tpot=0.2, replicas=(2, 2))
    model.observe(busy)
    assert model.estimate(busy)[1].wanted == 3  # broken SLO, nothing calibrated
    loaded = interval(prompt_rate=50.0, decode_running=0.8, replicas=(2, 2))
    model.observe(loaded)
    assert [e.wanted for e in model.estimate(loaded)] == [2, 2]
    idle = interval(replicas=(2, 2))
    for _ in range(20):
        model.observe(idle)
    assert model.decode_load.level >= 0 and model.prefill_load.level >= 0
    assert [e.wanted for e in model.estimate(idle)] == [1, 1]


def test_a_falling_load_never_forecasts_below_zero() -> None:
    forecast = Forecast(0.3)
    for value in (30.0, 20.0, 5.0, 0.0, 0.0, 0.0):
        forecast.observe(value, 1.0)
        assert forecast.level >= 0.0


def test_a_step_in_load_is_answered_within_one_round_when_the_slo_is_broken() -> None:
    """Steady at 5,000 prompt tokens/s on 2 replicas of 3,500 (5,000 at 0.7 busy), then
    one interval of 20,000 with the TTFT broken: 6 replicas at once, where smoothing in
    the step (0.3 x 20,000 + 0.7 x 5,000 = 9,500) would have asked for 3."""
    config = PlannerConfig(
        prefill=PoolBounds(1, 16), prefill_tokens_per_s=5_000, lead_s=10, surge=math.inf
    )
    model = CapacityModel(config)
    for _ in range(10):
        model.observe(interval(prompt_rate=5_000, prefill_tps=5_000, replicas=(2, 1)))
    step = interval(prompt_rate=20_000, ttft=4.0, prefill_tps=5_000, replicas=(2, 1))
    model.observe(step)
    prefill, _ = model.estimate(step)
    assert prefill.slo_broken and prefill.wanted == prefill.load_wanted == 6
    assert model.prefill_load.level == pytest.approx(9_500)  # the forecast itself lags


def test_a_surge_restarts_the_forecast_and_noise_is_smoothed() -> None:
    forecast = Forecast(0.3, surge=0.25)
    forecast.observe(100.0, 10.0)
    forecast.observe(120.0, 10.0)  # within the surge margin: smoothed in
    assert forecast.level == pytest.approx(106.0)
    forecast.observe(400.0, 10.0)  # a step: taken as it is
    assert forecast.level == 400.0 and forecast.latest == 400.0


def test_noise_within_the_tolerance_does_not_grow_a_pool() -> None:
    """3 replicas carry 3 x 3,500 = 10,500 tokens/s at the target: 8% more keeps 3 (a
    ceil() would ask for 4), 15% more asks for 4; shrinking is not held back."""
    config = PlannerConfig(
        prefill=PoolBounds(1, 16), prefill_tokens_per_s=5_000, smoothing=1.0, tolerance=0.1
    )

    def wanted(rate: float) -> int:
        model = CapacityModel(config)
        s = interval(prompt_rate=rate, prefill_tps=5_000, replicas=(3, 1))
        model.observe(s)
        return model.estimate(s)[0].wanted

    assert wanted(10_500 * 1.08) == 3
    assert wanted(10_500 * 1.15) == 4
    assert wanted(10_500 * 0.6) == 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def estimate(current: int, wanted: int) -> Estimate:
    return Estimate("decode", current, wanted, 0.0, 0.0, None, False)


def test_the_decider_steps_up_fast_and_down_slowly() -> None:
    clock = Clock()
    config = PlannerConfig(
        scale_up_cooldown_s=30, scale_down_cooldown_s=120, down_stable_s=60, max_step_up=2
    )
    decider = Decider(config, clock)
    up = decider.decide(estimate(1, 6))
    assert up.target == 3 and up.reason == "load"  # at most max_step_up at once
    clock.now += 10
    assert decider.decide(estimate(3, 6)).target == 3  # up-cooldown
    clock.now += 25
    assert decider.decide(estimate(3, 6)).target == 5
    # Down: only once the lower count was wanted for down_stable_s, one at a time,
    # and never within the down-cooldown of the last change.
    clock.now += 10
    assert decider.decide(estimate(5, 1)).target == 5
    clock.now += 70
    held = decider.decide(estimate(5, 1))
    assert held.target == 5 and "down-cooldown" in held.reason
    clock.now += 60
    assert decider.decide(estimate(5, 1)).target == 4
    # A wanted count that flaps back up resets the down timer.
    clock.now += 200
    assert decider.decide(estimate(4, 5)).target == 5
    clock.now += 200
    assert decider.decide(estimate(5, 2)).target == 5  # lower wanted: timer starts now
    clock.now += 61
    assert decider.decide(estimate(5, 2)).target == 4


def test_the_up_cooldown_holds_back_the_slo_guard_only() -> None:
    """Within the up-cooldown, a count the load asks for is acted on (it does not depend
    on the last change), the guard's extra replica waits."""
    clock = Clock()
    decider = Decider(PlannerConfig(scale_up_cooldown_s=30, max_step_up=4), clock)
    assert decider.decide(estimate(2, 4)).target == 4
    clock.now += 10
    guard = Estimate("decode", 4, 5, 0.0, 0.0, None, True, load_wanted=4)
    assert decider.decide(guard).target == 4  # +1 for a broken SLO: cooldown
    grown = Estimate("decode", 4, 8, 0.0, 0.0, None, True, load_wanted=7)
    assert decider.decide(grown).target == 7  # the load's own count: at once


def test_bounds_are_kept() -> None:
    config = PlannerConfig(decode=PoolBounds(2, 3), smoothing=1.0)
    model = CapacityModel(config)
    busy = interval(decode_running=300, tpot=0.2, replicas=(1, 2))
    model.observe(busy)
    assert model.estimate(busy)[1].wanted == 3
    idle = interval(decode_running=0, replicas=(1, 3))
    model = CapacityModel(replace(config, decode_seqs_per_replica=10.0))
    model.observe(idle)
    assert model.estimate(idle)[1].wanted == 2
    with pytest.raises(ValueError, match="replica bounds"):
        PoolBounds(3, 2)


def test_dry_run_remembers_what_it_would_have_done() -> None:
    dry = DryRun(prefill=1, decode=1)
    dry.scale("decode", 3)
    assert dry.replicas("decode") == 3 and dry.replicas("prefill") == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_planner_scales_a_real_decode_pool_up_and_drains_it_down(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path: Path
) -> None:
    spec = cluster_spec(
        make_checkpoint("llama"),
        redis_url,
        tmp_path,
        "planner",
        worker_args=("--num-kv-blocks", "256", "--max-model-len", "256"),
        worker_env=SLOW_DECODE_0,
        metrics_port=0,
    )
    config = tpot_breach_planner()
    greedy = common_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = random_prompts(8, 200, (20, 40), seed=9)
    with LocalCluster(spec) as cluster:

        def endpoints() -> Endpoints:
            url = lambda name: f"http://127.0.0.1:{cluster.metrics_ports[name]}/metrics"  # noqa: E731
            return Endpoints(
                url("router"),
                [url(n) for n in cluster.workers("prefill")],
                [url(n) for n in cluster.workers("decode")],
            )

        planner = Planner(config, ClusterActuator(cluster), endpoints, cluster.model_name)
        assert planner.tick() == []  # the first scrape: nothing to compare yet
        results = asyncio.run(complete_all(cluster.router_address, prompts, greedy))
        decisions = {d.pool: d for d in planner.tick()}
        assert decisions["decode"].estimate.slo_broken
        assert decisions["decode"].target == 2
        assert cluster.workers("decode") == ["decode-0", "decode-1"]
        assert decisions["prefill"].target == 1
        cluster.wait_for_workers(1, 2, timeout_s=30)
        assert planner.metrics.value("planner_target_replicas", pool="decode") == 2
        events = planner.metrics.value("planner_scale_events_total", pool="decode", direction="up")
        assert events == 1

        # The load falls to two streams: the next round wants one decode worker and
        # drains the newest while they run; both are answered in full.
        late: list = []
        streaming = threading.Thread(
            target=lambda: late.extend(
                asyncio.run(complete_all(cluster.router_address, prompts[:2], greedy))
            )
        )
        streaming.start()
        decisions = {d.pool: d for d in planner.tick()}
        streaming.join(timeout=120)
        assert decisions["decode"].target == 1, decisions["decode"]
        assert cluster.workers("decode") == ["decode-0"]
        cluster.wait_for_workers(1, 1, timeout_s=60)
        assert [r.finish_reason for r in [*results, *late]] == ["length"] * 10


@pytest.mark.parametrize(
    "command",
    [
        ["planner", "--router-metrics", "http://127.0.0.1:9/metrics"],
        ["serve", "--planner"],  # refused before anything starts
    ],
)
def test_the_commands_refuse_impossible_bounds(command: list[str]) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *command, "--min-decode", "3", "--max-decode", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "replica bounds must satisfy 0 <= min <= max, got 3, 2" in done.stderr
