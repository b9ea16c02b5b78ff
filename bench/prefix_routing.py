"""Prefix-aware routing on a real cluster: the same requests through round robin and
through prefix_aware, side by side in one run.

    python bench/prefix_routing.py [--workloads shared,chat] [--policies round_robin,prefix_aware]
        [--prefill-workers 2] [--num-requests 300] [--rate 8] [--num-kv-blocks 640]
        [--wait-quiet S] [--json OUT]

For each policy a fresh cluster (embedded Redis, ``--prefill-workers`` prefill workers,
one decode worker, the router; the built-in tiny model made in a temporary directory)
serves the workload open-loop (``bench/loadgen.py``): shared = one of 16 system prompts
of 1,000-1,800 tokens plus a short unique suffix, chat = 24 multi-turn conversations
(``bench/prefix_workloads.py``). Workers get ``--num-kv-blocks`` each: enough for their
share of the prefixes, not for all of them (KV memory, not compute, is what bounds a
real cache). Reports TTFT / E2E percentiles from the client's clock, and the router's
hit rate and prefill tokens computed (its ``/metrics``), with the CPU load of other
processes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.loadgen import PlannedRequest, Report, Slo, run_load, summarize
from tandem.bench.machine_load import OtherLoad, processes_cpu_s, wait_for_quiet
from tandem.bench.prefix_workloads import SegmentTokens, Shape, WorkloadSpec, generate
from tandem.bench.workloads import IntRange, TokenPool
from tandem.common.client import AsyncGenerationClient
from tandem.common.metrics import Scrape


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    workload: str
    policy: str
    report: Report
    hit_rate: float
    prefill_tokens_computed: int
    other_cores: float | None


def workload(name: str, num_requests: int, rate: float, seed: int) -> WorkloadSpec:
    output = IntRange(8, 16)
    if name == "shared":
        return WorkloadSpec(Shape.SHARED, rate, num_requests, output, seed, num_prefixes=16)
    if name == "chat":
        return WorkloadSpec(Shape.CHAT, rate, num_requests, output, seed, num_conversations=24)
    raise ValueError(f"unknown workload {name!r} (shared, chat)")


def plan(spec: WorkloadSpec, pool: TokenPool) -> tuple[PlannedRequest, ...]:
    tokens = SegmentTokens(pool)
    return tuple(
        PlannedRequest(p.at, tuple(p.token_ids(tokens)), p.max_tokens) for p in generate(spec)
    )


def run_policy(args, model_dir: Path, name: str, policy: str, planned) -> PolicyRun:
    from tandem.cli.launcher import ClusterSpec, LocalCluster

    metrics_port = _free_port()
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_prefill=args.prefill_workers,
        num_decode=1,
        router_port=_free_port(),
        worker_args=("--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "64"),
        router_args=(
            *("--prefill-policy", policy, "--decode-policy", policy),
            *("--metrics-port", str(metrics_port)),
        ),
        threads_per_worker=1,
        log_dir=Path(tempfile.mkdtemp(prefix=f"prefix-routing-{policy}-")),
    )
    with LocalCluster(spec) as cluster:
        time.sleep(1.0)  # let the router's KV index sync with the fresh workers
        pids = [child.process.pid for child in cluster.children.values()]
        if cluster.redis is not None:
            pids.append(cluster.redis.pid)
        meter, cluster_cpu = OtherLoad.start(), processes_cpu_s(pids)

        async def go():
            async with AsyncGenerationClient(cluster.router_address) as client:
                return await run_load(client, planned, timeout_s=120)

        results, duration = asyncio.run(go())
        other = meter.cores(processes_cpu_s(pids) - cluster_cpu)
        metrics = _scrape(metrics_port)
    report = summarize(results, duration, Slo())
    prompt = metrics.value("router_prompt_tokens_total")
    cached = metrics.value("router_cached_prompt_tokens_total")
    return PolicyRun(
        name, policy, report, cached / prompt if prompt else 0.0, int(prompt - cached), other
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> Scrape:
    return Scrape.of(f"http://127.0.0.1:{port}/metrics")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="shared,chat")
    parser.add_argument("--policies", default="round_robin,prefix_aware")
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s")
    parser.add_argument("--num-kv-blocks", type=int, default=640, help="per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from tandem.tools.checkpoint_maker import make_model

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "tiny", arch="llama", size="tiny")
        pool = TokenPool.from_checkpoint(model_dir)
        for name in args.workloads.split(","):
            planned = plan(workload(name, args.num_requests, args.rate, args.seed), pool)
            for policy in args.policies.split(","):
                if args.wait_quiet:
                    wait_for_quiet(args.wait_quiet)
                runs.append(run_policy(args, model_dir, name, policy, planned))
                print(_row(runs[-1]), flush=True)
    print(format_table(args, runs))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    return 0


def format_table(args, runs: Sequence[PolicyRun]) -> str:
    lines = [
        f"\n{args.prefill_workers} prefill + 1 decode worker(s), tiny model, {args.num_requests}"
        f" requests at {args.rate:g}/s, {args.num_kv_blocks} KV blocks per worker\n",
        "| workload | policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | hit rate"
        " | prefill tokens computed | completed | other cores busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        t, e = r.report.ttft_ms, r.report.e2e_ms
        other = "-" if r.other_cores is None else f"{r.other_cores:.2f}"
        lines.append(
            f"| {r.workload} | {r.policy} | {t.p50:.1f} | {t.p90:.1f} | {t.p99:.1f} | {e.p50:.1f}"
            f" | {r.hit_rate:.1%} | {r.prefill_tokens_computed:,} | {r.report.num_completed}"
            f"/{r.report.num_requests} | {other} |"
        )
    return "\n".join(lines)


def _row(r: PolicyRun) -> str:
    t = r.report.ttft_ms
    return (
        f"{r.workload:7s} {r.policy:13s} TTFT p50 {t.p50:7.1f} p99 {t.p99:7.1f} ms, hit rate "
        f"{r.hit_rate:.1%}, {r.prefill_tokens_computed:,} prefill tokens"
    )


if __name__ == "__main__":
    sys.exit(main())
