"""The fleet simulator's command line: routers side by side on the four workloads.

    python bench/sim/run.py [--workloads chat,shared,unique,skewed]
        [--routers round_robin,least_loaded,prefix_aware,oracle]
        [--prefill-workers 500 --decode-workers 500 --rate 10000 --duration 60 --warmup 10]
        [--calibration tiny] [--event-lag-ms 5] [--imbalance-limit 1.25]
        [--imbalance-slack 256] [--jobs 2] [--json OUT] [--wait-quiet S]

Every (workload, router) cell is one simulation of the same requests (a cell per
process, ``--jobs`` at a time). Prints, per workload, each router's hit rate, prefill
tokens computed (and their ratio to the oracle's and round robin's), TTFT and TPOT
percentiles, load imbalance and decision time, then checks the routing targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.machine_load import OtherLoad, wait_for_quiet
from tandem.bench.prefix_workloads import Shape, WorkloadSpec, generate
from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.fleet import ROUTERS, FleetSim, FleetSpec, SimResult
from tandem.cli.options import float_or_off
from tandem.common.registry import WorkerRole
from tandem.router.routing.prefix_aware import PrefixCost


@dataclasses.dataclass(frozen=True)
class Cell:
    workload: WorkloadSpec
    router: str
    fleet: FleetSpec
    calibration: str
    prefill_cost: PrefixCost


def workload_specs(rate: float, duration_s: float, num_prefill: int, seed: int = 0):
    """The four workloads at ``rate`` for ``duration_s``, sized to the fleet: about five
    shared prefixes and sixteen live conversations per prefill worker."""
    n = max(1, int(rate * duration_s))
    common = {"rate": rate, "num_requests": n, "seed": seed}
    return {
        "chat": WorkloadSpec(Shape.CHAT, num_conversations=16 * num_prefill, **common),
        "shared": WorkloadSpec(Shape.SHARED, num_prefixes=5 * num_prefill, **common),
        "unique": WorkloadSpec(Shape.UNIQUE, **common),
        "skewed": WorkloadSpec(Shape.SKEWED, num_prefixes=5 * num_prefill, **common),
    }


def run_cell(cell: Cell) -> SimResult:
    sim = FleetSim(
        cell.fleet, Calibration.named(cell.calibration), cell.router, prefill_cost=cell.prefill_cost
    )
    result = sim.run(generate(cell.workload))
    result.peak_memory_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.wait_quiet:
        wait_for_quiet(args.wait_quiet)
    fleet = FleetSpec(
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        event_lag_s=args.event_lag_ms / 1000,
        warmup_s=args.warmup,
    )
    specs = workload_specs(
        args.rate, args.duration + args.warmup, args.prefill_workers, seed=args.seed
    )
    workloads = args.workloads.split(",")
    routers = args.routers.split(",")
    cost = PrefixCost(
        imbalance_limit=args.imbalance_limit,
        imbalance_slack=args.imbalance_slack,
        busy_slack=None if args.imbalance_busy_slack == "off" else args.imbalance_busy_slack,
        busy_min_holders=args.busy_min_holders,
        busy_limit=args.imbalance_busy_limit,
        idle_choices=args.idle_choices,
    )
    cells = [Cell(specs[w], r, fleet, args.calibration, cost) for w in workloads for r in routers]
    meter, started = OtherLoad.start(), time.monotonic()
    # A fresh process per cell, so each cell's peak memory is its own.
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
        results = pool.map(run_cell, cells, chunksize=1)
    other = meter.cores()
    by_cell = {(c.workload.shape.value, c.router): r for c, r in zip(cells, results, strict=True)}
    print(_header(args, fleet, time.monotonic() - started, other))
    for workload in workloads:
        print(format_table(workload, {r: by_cell[(workload, r)] for r in routers}))
    print(format_targets(by_cell))
    if args.json:
        doc = {
            "args": vars(args),
            "other_cores_busy": other,
            "results": [
                {"workload": w, **dataclasses.asdict(r), "hit_rate": r.hit_rate}
                for (w, _), r in by_cell.items()
            ],
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="chat,shared,unique,skewed")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--prefill-workers", type=int, default=500)
    p.add_argument("--decode-workers", type=int, default=500)
    p.add_argument("--rate", type=float, default=10_000.0, help="requests/s")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    p.add_argument("--calibration", default="tiny", help="bench/sim/calibration_<name>.json")
    p.add_argument("--event-lag-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0, help="the workloads' random seed")
    defaults = PrefixCost.default_for(WorkerRole.PREFILL)
    p.add_argument(
        "--imbalance-limit",
        type=float,
        default=defaults.imbalance_limit,
        help="prefill pool's load guard, as the router's flag",
    )
    p.add_argument("--imbalance-slack", type=float, default=defaults.imbalance_slack)
    p.add_argument(
        "--imbalance-busy-slack",
        type=float_or_off,
        default=defaults.busy_slack,
        help="prefill pool's busy guard, as the router's flag ('off' turns it off)",
    )
    p.add_argument("--imbalance-busy-limit", type=float, default=defaults.busy_limit)
    p.add_argument("--busy-min-holders", type=int, default=defaults.busy_min_holders)
    p.add_argument("--idle-choices", type=int, default=defaults.idle_choices)
    p.add_argument("--jobs", type=int, default=2, help="simulations at once")
    p.add_argument("--json", type=Path)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    return p


def _header(args, fleet: FleetSpec, wall_s: float, other: float | None) -> str:
    load = "unknown" if other is None else f"{other:.2f}"
    busy = args.imbalance_busy_slack
    busy_guard = ", busy guard off"
    if busy not in (None, "off"):
        busy_guard = (
            f", busy share {args.imbalance_busy_limit:g} x mean + {busy:g}"
            f" for prefixes {args.busy_min_holders}+ workers hold"
        )
    busy_guard += f", least busy of {args.idle_choices} idle"
    return (
        f"{fleet.num_prefill} prefill + {fleet.num_decode} decode workers, "
        f"{args.rate:g} requests/s, {args.duration:g} s measured after {args.warmup:g} s, "
        f"seed {args.seed}, calibration {args.calibration!r}, "
        f"event lag {args.event_lag_ms:g} ms, prefill guard "
        f"{args.imbalance_limit:g} x mean + {args.imbalance_slack:g}"
        f"{busy_guard}; "
        f"{wall_s:.0f} s wall, other processes used {load} cores"
    )


def format_table(workload: str, results: dict[str, SimResult]) -> str:
    oracle = results.get("oracle")
    rr = results.get("round_robin")
    lines = [
        f"\n### {workload}\n",
        "| router | hit rate | prefill tokens | vs oracle | round robin / this | TTFT p50 / p99 ms"
        " | TPOT p50 / p99 ms | imbalance: queue / work | decision p50 / p99 µs | requests"
        " | index entries | peak memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        vs_oracle = _ratio(r.computed_tokens, oracle.computed_tokens if oracle else None)
        vs_rr = _ratio(rr.computed_tokens if rr else None, r.computed_tokens)
        lines.append(
            f"| {name} | {r.hit_rate:.1%} | {r.computed_tokens / 1e6:,.1f} M | {vs_oracle}"
            f" | {vs_rr} | {r.ttft_ms['p50']:.1f} / {r.ttft_ms['p99']:.1f}"
            f" | {r.tpot_ms['p50']:.2f} / {r.tpot_ms['p99']:.2f}"
            f" | {r.queue_imbalance:.2f} / {r.work_imbalance:.2f}"
            f" | {r.decision_us['p50']:.0f} / {r.decision_us['p99']:.0f} | {r.requests:,}"
            f" | {r.index_entries / 1e6:.2f} M | {r.peak_memory_gb:.1f} GB |"
        )
    return "\n".join(lines)


def format_targets(by_cell: dict[tuple[str, str], SimResult]) -> str:
    lines = ["\n### targets\n"]

    def get(workload: str, router: str) -> SimResult | None:
        return by_cell.get((workload, router))

    for workload in ("chat", "shared"):
        pa, oracle, rr = (get(workload, r) for r in ("prefix_aware", "oracle", "round_robin"))
        if pa and oracle:
            ratio = pa.computed_tokens / oracle.computed_tokens
            lines.append(_check(f"{workload}: prefill tokens vs oracle {ratio:.3f}x", ratio <= 1.1))
        if pa and rr:
            ratio = rr.computed_tokens / pa.computed_tokens
            lines.append(_check(f"{workload}: round robin computes {ratio:.1f}x more", ratio >= 2))
    pa = get("skewed", "prefix_aware")
    if pa:
        lines.append(
            _check(
                f"skewed: queue imbalance {pa.queue_imbalance:.2f}, hit rate {pa.hit_rate:.1%}",
                pa.queue_imbalance <= 1.3,
            )
        )
    pa, ll = get("unique", "prefix_aware"), get("unique", "least_loaded")
    if pa and ll:
        ok = pa.ttft_ms["p99"] <= ll.ttft_ms["p99"] * 1.02
        lines.append(
            _check(
                f"unique: TTFT p99 {pa.ttft_ms['p99']:.1f} ms vs least_loaded "
                f"{ll.ttft_ms['p99']:.1f} ms",
                ok,
            )
        )
    return "\n".join(lines)


def _check(text: str, ok: bool) -> str:
    return f"- [{'x' if ok else ' '}] {text}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
