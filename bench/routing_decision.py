"""How long the router takes to route one request: hashing a prompt, asking the KV index,
merging in-flight load and running the prefix-aware policy, for both pools.

    python bench/routing_decision.py [--prompt-tokens 4096] [--workers 128]
        [--iterations 5000] [--wait-quiet S]

Drives the router's own code path (``Orchestrator._routing_request`` and ``_pick``, as
``Orchestrator.run`` calls them) against a registry snapshot of ``--workers`` prefill and
as many decode workers with random loads, and an index holding what a busy fleet holds:
every worker has 200 random prompts cached, and a quarter of the workers hold the
benchmark prompt's prefix at random depths. Each iteration routes a new prompt that
shares a 2k-token system prompt with the others. Prints p50 / p99 / max in µs (wall
clock, garbage collector on, as in the router), and the CPU load of other processes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from tandem.bench.machine_load import OtherLoad, wait_for_quiet
from tandem.common.hashing import hash_blocks
from tandem.common.kv_events.events import BlocksStored
from tandem.common.kv_events.wire import CacheSnapshot, EventBatch
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.common.sampling_params import SamplingParams
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.orchestrator import Orchestrator, OrchestratorConfig
from tandem.router.routing.inflight import InflightLoad
from tandem.router.routing.policy import PolicyName, make_policy
from tandem.router.validation import ValidatedRequest

BLOCK = 16


class SnapshotWatcher:
    """The part of ``RegistryWatcher`` the orchestrator reads: a fixed snapshot."""

    def __init__(self, records: Sequence[WorkerRecord]) -> None:
        self._by_role = {
            role: tuple(r for r in records if r.info.role is role) for role in WorkerRole
        }

    def workers(self, role: WorkerRole) -> tuple[WorkerRecord, ...]:
        return self._by_role[role]


def fleet(n: int, rng: random.Random) -> list[WorkerRecord]:
    capacity = WorkerCapacity(num_kv_blocks=65536, block_size=BLOCK, max_num_seqs=256)
    records = []
    for role, prefix in ((WorkerRole.PREFILL, "prefill"), (WorkerRole.DECODE, "decode")):
        for i in range(n):
            load = WorkerLoad(
                rng.randrange(1000, 65536), rng.randrange(0, 64), rng.randrange(0, 8),
                rng.randrange(0, 8192), 0.0,
            )  # fmt: skip
            info = WorkerInfo(f"{prefix}-{i:03d}", role, f"10.0.0.{i}:1", "m", capacity)
            records.append(WorkerRecord(info, load))
    return records


def warm_index(records: Sequence[WorkerRecord], system: list[int], rng: random.Random):
    indexer = KVIndexer()
    system_hashes = hash_blocks(system, BLOCK)
    for record in records:
        worker = record.info.worker_id
        indexer.worker_joined(worker)
        hashes = []
        for _ in range(200):
            hashes += hash_blocks([rng.randrange(32000) for _ in range(256)], BLOCK)
        if rng.random() < 0.25:
            hashes += system_hashes[: rng.randrange(1, len(system_hashes) + 1)]
        indexer.apply_snapshot(CacheSnapshot(worker, 1, 0, (), BLOCK))
        indexer.apply(EventBatch(worker, 1, 1, (BlocksStored(tuple(hashes), None),)))
    return indexer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=128, help="per pool")
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    records = fleet(args.workers, rng)
    system = [rng.randrange(32000) for _ in range(min(2048, args.prompt_tokens - 16))]
    indexer = warm_index(records, system, rng)
    orchestrator = Orchestrator(
        SnapshotWatcher(records),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  (no worker is called)
        make_policy(PolicyName.PREFIX_AWARE, WorkerRole.PREFILL),
        make_policy(PolicyName.PREFIX_AWARE, WorkerRole.DECODE),
        OrchestratorConfig(),
        indexer=indexer,
        inflight=InflightLoad(),
    )
    requests = [
        ValidatedRequest(
            f"req-{i}",
            tuple(system + [rng.randrange(32000) for _ in range(args.prompt_tokens - len(system))]),
            SamplingParams(max_tokens=64),
            0,
            None,
        )
        for i in range(args.iterations)
    ]
    if args.wait_quiet:
        wait_for_quiet(args.wait_quiet)
    meter = OtherLoad.start()
    totals, hashing, picks = [], [], []
    for request in requests:
        start = time.perf_counter()
        routing = orchestrator._routing_request(request)
        hashed = time.perf_counter()
        orchestrator._pick(WorkerRole.PREFILL, orchestrator.prefill_policy, routing, set())
        orchestrator._pick(WorkerRole.DECODE, orchestrator.decode_policy, routing, set())
        end = time.perf_counter()
        totals.append(end - start)
        hashing.append(hashed - start)
        picks.append(end - hashed)
    other = meter.cores()
    print(
        f"{args.prompt_tokens}-token prompts, {args.workers} prefill + {args.workers} decode "
        f"workers, {indexer.index.num_entries:,} index entries, {args.iterations} requests; "
        f"other processes used {other:.2f} cores"
    )
    print(f"{'µs':<36}{'p50':>8}{'p99':>8}{'max':>8}")
    for name, values in (
        ("hash the prompt", hashing),
        ("index + load + policy (both pools)", picks),
        ("total per request", totals),
    ):
        print(f"{name:<36}" + "".join(f"{v * 1e6:8.0f}" for v in _summary(values)))
    return 0


def _summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99, ordered[-1]


if __name__ == "__main__":
    sys.exit(main())
