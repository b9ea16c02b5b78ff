"""KV pull bandwidth: the decode side's full pull path against in-process copies.

    python bench/kvtransfer.py [--sizes-mb 1,4,16,64] [--repeats 7] [--rounds 3] [--threads N]

A prefill-side server (``tandem.kvtransfer.testing.RandomKVServer``: sender, lease table,
grpc.aio server, rendezvous store) runs in a child process on random KV; this process
is the decode worker. After one handshake, each timed pull is ``KVReceiver.pull``
(PullBlocks RPC, the server gathering the blocks from its paged cache and sending them
over gloo, the recv here) followed by ``unpack_blocks`` into this process's paged cache;
once into a new tensor per pull, once into a reused ``out``. The baselines copy the
same number of bytes in this process in the same round: ``copy`` into a reused buffer
(warm memcpy) and ``clone`` into a fresh one (memcpy plus faulting the pages in, as the
allocator hands large blocks back to the OS). Every figure is the median of
``--repeats`` after two warm-ups; ``--rounds`` repeats the whole table to show the
spread on a shared machine. Blocks are 1 MiB (8 layers x K,V x 16 slots x 8 heads x 64
dims, float32), scattered in both caches. Prints a table and writes
``bench/results/kvtransfer.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.bench.throughput import LoadMeter
from tandem.kvtransfer.blocks import pack_blocks, unpack_blocks
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.testing import RandomKVServer, RandomKVSpec, random_kv_caches

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(
    "bench", num_layers=8, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.float32
)
MIB = 1 << 20
TARGET_RATIO = 0.30
WARMUPS = 2


@dataclass(frozen=True)
class Sample:
    """One size in one round: median seconds of each step.

    ``copy_s`` copies into a warm, reused destination; ``clone_s`` into a fresh one (the
    allocator returns large blocks to the OS, so that includes faulting its pages in).
    ``pull_s`` is a pull into a new tensor, ``pull_out_s`` into a reused ``out``; both
    are followed by an unpack (``unpack_s``) into the decode cache.
    """

    round: int
    size_mb: int
    copy_s: float
    clone_s: float
    pull_s: float
    pull_out_s: float
    unpack_s: float
    other_load: float | None
    """Cores busy with other processes just before the round (``None``: unknown)."""

    def gbps(self, seconds: float) -> float:
        return self.size_mb * MIB / seconds / 1e9

    @property
    def rates(self) -> dict[str, float]:
        """GB/s of each measured path; pulls include the unpack."""
        return {
            "copy": self.gbps(self.copy_s),
            "clone": self.gbps(self.clone_s),
            "pull": self.gbps(self.pull_s + self.unpack_s),
            "pull_out": self.gbps(self.pull_out_s + self.unpack_s),
        }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    samples = asyncio.run(_measure(sizes, args.repeats, args.rounds, args.threads, args.wait_quiet))
    print(format_table(samples, sizes))
    out = args.results_dir / "kvtransfer.json"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_summary(samples, args), indent=2))
    print(f"\nwrote {out}")
    return 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,4,16,64", help="comma list of MiB per pull")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per size (median)")
    p.add_argument("--rounds", type=int, default=3, help="times the whole table is measured")
    p.add_argument("--threads", type=int, help="torch threads, both processes (default torch's)")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each round, wait up to this many seconds for other processes to go idle",
    )
    return p.parse_args(argv)


async def _measure(
    sizes: list[int], repeats: int, rounds: int, threads: int | None, wait_quiet_s: float
) -> list[Sample]:
    largest = max(sizes)
    generator = torch.Generator().manual_seed(0)
    prefill_blocks = torch.randperm(2 * largest, generator=generator)[:largest].tolist()
    decode_blocks = torch.randperm(2 * largest, generator=generator)[:largest].tolist()
    spec = RandomKVSpec(LAYOUT, 2 * largest, (tuple(prefill_blocks),), torch_threads=threads)
    decode_caches = random_kv_caches(LAYOUT, 2 * largest, seed=1)
    with RandomKVServer(spec) as server:
        receiver = KVReceiver(LAYOUT, "bench-decode", "cpu")
        lease = server.lease_ids[0]
        samples = []
        for round_ in range(rounds):
            load = _other_load(wait_quiet_s)
            for size in sizes:
                indices = list(range(size))
                out = torch.empty(LAYOUT.packed_shape(size), dtype=LAYOUT.dtype)

                async def pull(
                    indices: list[int] = indices, out: torch.Tensor | None = None
                ) -> torch.Tensor:
                    return await receiver.pull(server.endpoint, lease, indices, 60, out=out)

                def unpack(packed: torch.Tensor, size: int = size) -> None:
                    unpack_blocks(decode_caches, decode_blocks[:size], packed)

                pull_s, unpack_s = await _time_pull(pull, unpack, repeats)
                pull_out_s, _ = await _time_pull(functools.partial(pull, out=out), unpack, repeats)
                copy_s, clone_s = _time_copies(size * MIB, repeats)
                samples.append(
                    Sample(round_, size, copy_s, clone_s, pull_s, pull_out_s, unpack_s, load)
                )
            _check(out, spec, prefill_blocks[: sizes[-1]])
        assert receiver.stats.handshakes == 1, "the pair should have been reused"
        await receiver.close()
    return samples


async def _time_pull(
    pull: Callable[[], Awaitable[torch.Tensor]],
    unpack: Callable[[torch.Tensor], None],
    repeats: int,
) -> tuple[float, float]:
    pull_times, unpack_times = [], []
    for i in range(WARMUPS + repeats):
        started = time.perf_counter()
        packed = await pull()
        pulled = time.perf_counter()
        unpack(packed)
        done = time.perf_counter()
        if i >= WARMUPS:
            pull_times.append(pulled - started)
            unpack_times.append(done - pulled)
    return statistics.median(pull_times), statistics.median(unpack_times)


def _time_copies(nbytes: int, repeats: int) -> tuple[float, float]:
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dest = torch.empty_like(source)
    copy_times, clone_times = [], []
    for i in range(WARMUPS + repeats):
        started = time.perf_counter()
        dest.copy_(source)
        copied = time.perf_counter()
        clone = source.clone()
        cloned = time.perf_counter()
        del clone
        if i >= WARMUPS:
            copy_times.append(copied - started)
            clone_times.append(cloned - copied)
    return statistics.median(copy_times), statistics.median(clone_times)


def _other_load(wait_s: float, quiet: float = 0.2, window_s: float = 1.0) -> float | None:
    """Cores used by other processes over a window while this benchmark idles; repeats
    windows for up to ``wait_s`` seconds until that is under ``quiet``."""
    deadline = time.monotonic() + wait_s
    while True:
        meter = LoadMeter.start()
        time.sleep(window_s)
        load = meter.other_load()
        if load is None or load < quiet or time.monotonic() >= deadline:
            return load


def _check(packed: torch.Tensor, spec: RandomKVSpec, prefill_blocks: list[int]) -> None:
    caches = random_kv_caches(spec.layout, spec.num_blocks, spec.seed)
    if not torch.equal(packed, pack_blocks(caches, prefill_blocks)):
        raise AssertionError("pulled blocks differ from the sender's")


def format_table(samples: list[Sample], sizes: list[int]) -> str:
    rounds = max(s.round for s in samples) + 1
    lines = [
        f"threads={torch.get_num_threads()}, rounds={rounds}: GB/s median [min-max] over rounds",
        "copy: into a reused buffer; clone: into a fresh one; pull: PullBlocks + recv +"
        " unpack into a new tensor; pull->out: the same into a reused `out`",
        f"{'MiB':>4} {'copy':>18} {'clone':>16} {'pull':>16} {'pull->out':>16}"
        f" {'pull->out/copy':>16} {'pull/clone':>16} {'other':>5}",
        "(other: most cores used by other processes just before a round)",
    ]
    for size in sizes:
        rows = [s.rates for s in samples if s.size_mb == size]
        cells = [_spread([r[k] for r in rows]) for k in ("copy", "clone", "pull", "pull_out")]
        ratios = [
            _spread([r["pull_out"] / r["copy"] for r in rows], ".0%"),
            _spread([r["pull"] / r["clone"] for r in rows], ".0%"),
        ]
        loads = [s.other_load for s in samples if s.size_mb == size and s.other_load is not None]
        load = f"{max(loads):.1f}" if loads else "-"
        lines.append(
            f"{size:>4} {cells[0]:>18} {cells[1]:>16} {cells[2]:>16} {cells[3]:>16}"
            f" {ratios[0]:>16} {ratios[1]:>16} {load:>5}"
        )
    largest = [s.rates for s in samples if s.size_mb == max(sizes)]
    for label, pull, base in [
        ("pull->out/copy", "pull_out", "copy"),
        ("pull/clone", "pull", "clone"),
    ]:
        ratio = statistics.median(r[pull] / r[base] for r in largest)
        verdict = "meets" if ratio >= TARGET_RATIO else "misses"
        lines.append(
            f"{label} at {max(sizes)} MiB: {ratio:.0%} ({verdict} the {TARGET_RATIO:.0%} target)"
        )
    return "\n".join(lines)


def _spread(values: list[float], spec: str = ".2f") -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:{spec}} [{low:{spec}}-{high:{spec}}]"


def _summary(samples: list[Sample], args: argparse.Namespace) -> dict[str, object]:
    return {
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "samples": [{**asdict(s), "gbps": s.rates} for s in samples],
    }


if __name__ == "__main__":
    raise SystemExit(main())
