"""The SLO planner against an HPA and a static fleet, on a simulated fleet replaying a
trace (``docs/benchmarks/planner.md``).

    python -m tandem.bench.planner_sim [--trace bench/traces/diurnal_burst.csv]
        [--ttft-slo-ms 2000] [--tpot-slo-ms 50] [--startup-s 11.2] [--seed 0]
        [--policies planner,hpa,static] [--jobs 1]

Replays the trace's requests (Poisson arrivals, seeded) through the elastic fleet of
``tandem.bench.sim.elastic`` once per policy: the real planner (``PlannerScaler``), a
Kubernetes-style HPA on queue length and utilisation (``HpaScaler``) and a static fleet
sized for the trace's peak. Prints what each policy was configured with, a table of
SLO attainment, latency and replica-hours per policy, the targets, and last one JSON
object: per policy ``slo_attainment`` and ``replica_hours`` (prefill, decode, total).

Defaults and where they come from: the step costs are ``bench/sim/calibration_tiny.json``
(the real engine timed by ``bench/sim/calibrate.py``); ``--max-num-seqs`` is the engine's
default; ``--startup-s`` is the measured time from ``tandem serve --ray`` to the first
token (``python -m tandem.bench.ray_startup``, README "Running on Ray": 11.2 s at TP=1);
the planner's settings are ``tandem planner``'s defaults but for the SLOs, the bounds and
``--lead-time``, which is set to the start-up delay as its help says.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.capacity import Mix, ReplicaModel, mean_mix, peak_fleet
from tandem.bench.sim.elastic import POOLS, ElasticFleet, FleetConfig, FleetResult, Scaler
from tandem.bench.sim.scalers import HpaConfig, HpaScaler, PlannerScaler, StaticScaler
from tandem.bench.sim.trace import Trace, TraceError, arrivals
from tandem.planner.policy import PlannerConfig, PoolBounds

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE / "traces" / "diurnal_burst.csv"
POLICIES = ("planner", "hpa", "static")
STARTUP_S = 11.2
"""README "Running on Ray": ``tandem serve --ray`` to the first token, TP=1, median of 3."""
TARGET_ATTAINMENT = 0.99
TARGET_SAVING = 0.30


@dataclass(frozen=True)
class Setup:
    """Everything one policy's run needs (picklable: a run may go to another process)."""

    trace: Trace
    seed: int
    spread: float
    fleet: FleetConfig
    planner: PlannerConfig
    planner_interval_s: float
    hpa: HpaConfig
    static: tuple[int, int]
    initial: tuple[int, int]
    """The autoscalers' fleet at time 0: sized for the first segment, as if running."""

    @property
    def mix(self) -> Mix:
        return mean_mix(self.trace, self.spread)


def make_setup(args: argparse.Namespace, trace: Trace) -> Setup:
    model = ReplicaModel(Calibration.named(args.calibration), args.max_num_seqs)
    ttft, tpot = args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3
    fleet = FleetConfig(model, args.startup_s, ttft, tpot)
    bounds = PoolBounds(1, args.max_replicas)
    lead = args.lead_s if args.lead_s is not None else max(args.startup_s, 1.0)
    planner = PlannerConfig(
        ttft_p99_s=ttft, tpot_p99_s=tpot, prefill=bounds, decode=bounds,
        target_busy=args.utilisation, lead_s=lead,
    )  # fmt: skip
    mix = mean_mix(trace, args.spread)
    hpa = HpaConfig(
        prefill_busy=args.utilisation,
        prefill_queued_tokens=model.prefill_tokens_per_s(mix) * ttft / 2,
        decode_sequences=args.utilisation * model.slo_batch(mix, tpot),
        prefill=bounds,
        decode=bounds,
    )
    first = trace.segments[0]
    initial = model.replicas_for(first.rate_rps, Mix.of(first, args.spread), tpot, args.utilisation)
    static = peak_fleet(trace, model, tpot, args.utilisation, args.spread)
    return Setup(
        trace, args.seed, args.spread, fleet, planner, args.planner_interval, hpa, static, initial
    )


def run_policy(policy: str, setup: Setup) -> FleetResult:
    """One replay of the trace's requests under ``policy``."""
    scaler: Scaler
    if policy == "planner":
        scaler, start = PlannerScaler(setup.planner, setup.planner_interval_s), setup.initial
    elif policy == "hpa":
        scaler, start = HpaScaler(setup.hpa), setup.initial
    elif policy == "static":
        scaler, start = StaticScaler(), setup.static
    else:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    requests = arrivals(setup.trace, setup.seed, setup.spread)
    fleet = ElasticFleet(setup.fleet, dict(zip(POOLS, start, strict=True)))
    return fleet.run(requests, scaler, setup.trace.end_s)


def summary(trace: Trace, seed: int, results: dict[str, FleetResult]) -> dict:
    """The JSON line: per policy, SLO attainment and replica-hours."""
    return {
        "trace": Path(trace.name).stem,
        "seed": seed,
        "requests": next(iter(results.values())).requests if results else 0,
        "policies": {
            name: {
                "slo_attainment": round(r.slo_attainment, 5),
                "replica_hours": {
                    "prefill": round(r.replica_hours["prefill"], 3),
                    "decode": round(r.replica_hours["decode"], 3),
                    "total": round(r.total_replica_hours, 3),
                },
            }
            for name, r in results.items()
        },
    }


def format_setup(setup: Setup, requests: int) -> str:
    f, model, mix = setup.fleet, setup.fleet.model, setup.mix
    pc, hpa = setup.planner, setup.hpa
    return "\n".join(
        [
            f"trace {setup.trace.name}: {setup.trace.end_s / 3600:.2f} h, {requests:,} requests "
            f"(seed {setup.seed}); TTFT <= {f.ttft_slo_s * 1e3:.0f} ms, "
            f"TPOT <= {f.tpot_slo_s * 1e3:.0f} ms",
            f"replica (calibration: {model.calibration.model}): at the trace's mean mix "
            f"({mix.prompt_tokens:.0f} prompt / {mix.output_tokens:.0f} output tokens) "
            f"prefill {model.prefill_tokens_per_s(mix):,.0f} tok/s busy, decode "
            f"{model.slo_batch(mix, f.tpot_slo_s)} sequences within TPOT "
            f"(max_num_seqs {model.max_num_seqs}); start-up {f.startup_s:g} s",
            f"static fleet (peak at {pc.target_busy:.0%}): {setup.static[0]} prefill + "
            f"{setup.static[1]} decode; autoscalers start at {setup.initial[0]} + "
            f"{setup.initial[1]}, bounds {pc.prefill.min_replicas}-{pc.prefill.max_replicas}",
            f"planner: interval {setup.planner_interval_s:g} s, lead {pc.lead_s:g} s, target "
            f"busy {pc.target_busy:g}, cooldowns up {pc.scale_up_cooldown_s:g} s / down "
            f"{pc.scale_down_cooldown_s:g} s, down-stable {pc.down_stable_s:g} s",
            f"hpa: sync {hpa.sync_s:g} s, prefill busy {hpa.prefill_busy:g} or "
            f"{hpa.prefill_queued_tokens:,.0f} queued tokens per replica, decode "
            f"{hpa.decode_sequences:.0f} sequences per replica, down window "
            f"{hpa.down_window_s:g} s",
        ]
    )


def format_table(results: dict[str, FleetResult]) -> str:
    static = results.get("static")
    lines = [
        "| policy | SLO attainment | TTFT met | TPOT met | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| replica-hours prefill / decode / total | vs static | peak replicas | scale events "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        versus = "-"
        if static is not None and static.total_replica_hours > 0:
            versus = f"{r.total_replica_hours / static.total_replica_hours - 1:+.1%}"
        lines.append(
            f"| {name} | {r.slo_attainment:.2%} | {r.ttft_met / max(1, r.requests):.2%} "
            f"| {r.tpot_met / max(1, r.requests):.2%} "
            f"| {r.ttft_ms['p50']:.0f} / {r.ttft_ms['p99']:.0f} "
            f"| {r.tpot_ms['p50']:.1f} / {r.tpot_ms['p99']:.1f} "
            f"| {r.replica_hours['prefill']:.1f} / {r.replica_hours['decode']:.1f} / "
            f"{r.total_replica_hours:.1f} | {versus} "
            f"| {r.peak_replicas['prefill']} + {r.peak_replicas['decode']} "
            f"| {r.scale_events['prefill']} + {r.scale_events['decode']} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)


def format_targets(results: dict[str, FleetResult]) -> str:
    planner, hpa, static = (results.get(p) for p in POLICIES)
    if planner is None:
        return "targets: the planner did not run"
    lines = []
    met = planner.slo_attainment >= TARGET_ATTAINMENT
    lines.append(
        f"planner SLO attainment >= {TARGET_ATTAINMENT:.0%}: {_yes(met)} "
        f"({planner.slo_attainment:.2%})"
    )
    if static is not None:
        saving = 1 - planner.total_replica_hours / static.total_replica_hours
        lines.append(
            f"planner replica-hours >= {TARGET_SAVING:.0%} below static: "
            f"{_yes(saving >= TARGET_SAVING)} ({saving:.1%} below)"
        )
    if hpa is not None:
        if planner.slo_attainment == hpa.slo_attainment:
            verdict = "tied"
        else:
            verdict = _yes(planner.slo_attainment > hpa.slo_attainment)
        lines.append(
            f"planner attainment above the HPA's: {verdict} "
            f"({planner.slo_attainment:.2%} vs {hpa.slo_attainment:.2%})"
        )
    return "\n".join(lines)


def _yes(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        trace = Trace.read(args.trace)
    except TraceError as err:
        parser.error(str(err))
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {unknown}, choose from {list(POLICIES)}")
    try:
        setup = make_setup(args, trace)
    except ValueError as err:
        parser.error(str(err))
    print(format_setup(setup, len(arrivals(trace, args.seed, args.spread))), flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(min(args.jobs, len(policies))) as pool:
            done = list(pool.map(run_policy, policies, [setup] * len(policies)))
    else:
        done = [run_policy(p, setup) for p in policies]
    results = dict(zip(policies, done, strict=True))
    if args.timeline_dir:
        _write_timelines(args.timeline_dir, Path(trace.name).stem, results)
    print(format_table(results))
    print(format_targets(results))
    print(json.dumps(summary(trace, args.seed, results)))
    return 0


def _write_timelines(folder: Path, stem: str, results: dict[str, FleetResult]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        rows = ["t_s,pool,replicas_set,replicas_serving"]
        rows += [f"{t:.1f},{pool},{n},{serving}" for t, pool, n, serving in r.timeline]
        (folder / f"{stem}-{name}.csv").write_text("\n".join(rows) + "\n")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="CSV: t_s,rate_rps,...")
    p.add_argument("--ttft-slo-ms", type=_positive, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=_positive, default=50.0)
    p.add_argument(
        "--startup-s",
        type=float,
        default=STARTUP_S,
        help=f"asked for -> serving (default {STARTUP_S}: measured, see the module doc)",
    )
    p.add_argument("--calibration", default="tiny", help="bench/sim/calibration_<name>.json")
    p.add_argument("--max-num-seqs", type=int, default=128, help="the engine's default")
    p.add_argument("--seed", type=int, default=0, help="the arrivals' random seed")
    p.add_argument("--spread", type=float, default=0.5, help="lengths: mean * (1 +- spread)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--utilisation",
        type=_positive,
        default=0.7,
        help="planned share of a replica's capacity: the planner's --target-busy, the HPA's "
        "targets and the static sizing (default: the planner's own)",
    )
    p.add_argument("--max-replicas", type=int, default=64, help="per pool, autoscalers")
    p.add_argument("--planner-interval", type=_positive, default=10.0)
    p.add_argument("--lead-s", type=_positive, help="planner lead time (default: --startup-s)")
    p.add_argument("--jobs", type=int, default=1, help="policies run side by side")
    p.add_argument("--timeline-dir", type=Path, help="write each policy's replica counts here")
    return p


if __name__ == "__main__":
    sys.exit(main())
