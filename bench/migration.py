"""What live migration buys: how long a scale-down takes, and the pause a moved stream
sees, against waiting for the streams and against recomputing them, in the same run.

    python bench/migration.py [--model DIR] [--size medium] [--json PATH]

1. **Scale-down under load.** A cluster of 1 prefill + 2 decode workers (bfloat16, one
   thread each) runs ``--streams`` greedy streams of ``--tokens`` tokens; once every one
   is decoding, the decode worker running the most gets SIGTERM. Handing over (the
   default, ``--drain-migrate-after 0``) against waiting (``--drain-migrate-after`` =
   ``--drain-timeout`` = 300 s: the streams finish where they are, the behaviour before
   live migration); and ``kill -9``, whose streams the next worker recomputes from their
   tokens. Reported: seconds from the signal to the worker's exit, and how many streams
   equal the no-fault run (each run on a fresh cluster whose prefill worker takes one
   prompt per step, so two runs' rounding can differ only by what happens to the moved
   streams).
2. **The pause of one move.** One stream with an ``L``-token prompt is handed over
   (``Migrate``) after 32 tokens: the pause is the longest gap between two of its tokens.
   A recompute instead costs a prefill of ``L + 32`` tokens on the receiving worker:
   measured as the time to the first token of that prompt prefilled there (the router's
   ``--disaggregation-min-tokens`` above it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import time
from pathlib import Path

from tandem.bench.cluster_bench import LOG_DIR, checkpoint, emit, free_port, provenance
from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.protos import common_pb2, worker_pb2, worker_pb2_grpc

DECODERS = ("decode-0", "decode-1")


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """Random token ids (0-9 left out: special tokens live there)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def _greedy(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _run(
    cluster: LocalCluster, prompts: list[list[int]], n: int, act=None, after: int = 16
) -> tuple[list[list[int]], list[list[float]]]:
    """Every stream at once; ``act()`` (in a thread) once each has ``after`` tokens.
    Returns the tokens and each token's arrival time."""
    started = [asyncio.Event() for _ in prompts]

    async def one(client, i: int, prompt: list[int]):
        tokens: list[int] = []
        times: list[float] = []
        async for response in client.generate(build_request(prompt, _greedy(n)), timeout_s=900):
            tokens += response.token_ids
            times += [time.monotonic()] * len(response.token_ids)
            if len(tokens) >= after:
                started[i].set()
        return tokens, times

    async def trigger() -> None:
        await asyncio.gather(*(e.wait() for e in started))
        await asyncio.to_thread(act)

    async with AsyncGenerationClient(cluster.router_address) as client:
        jobs = [one(client, i, p) for i, p in enumerate(prompts)]
        if act is not None:
            jobs.append(trigger())
        results = await asyncio.gather(*jobs)
    pairs = results[: len(prompts)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _spec(model: str, log_dir: Path, name: str, decode_args=(), router_args=()) -> ClusterSpec:
    return ClusterSpec(
        model_dir=model,
        num_decode=2,
        router_port=free_port(),
        model_name=name,
        worker_args=("--dtype", "bfloat16", "--num-kv-blocks", "1024", "--max-model-len", "2048"),
        # One prompt per prefill step: its rounding then depends on the prompt alone (a
        # bigger bfloat16 batch takes other GEMM kernels), so runs are comparable token for
        # token; decode batches (a few rows) do not change kernels.
        prefill_args=("--max-num-seqs", "1"),
        decode_args=tuple(decode_args),
        router_args=("--decode-policy", "round_robin", *router_args),
        threads_per_worker=1,
        log_dir=log_dir,
    )


def scale_down(model: str, log_dir: Path, streams: int, tokens: int) -> dict:
    """Each run on a fresh cluster: a second run on the same one would find its prompts
    cached, compute only their last blocks, and round differently."""
    prompts = random_prompts(streams, 4096, (64, 128), seed=50)
    out: dict[str, dict] = {}
    reference = None
    modes = (
        ("no fault", None, None),
        ("hand over", "0", signal.SIGTERM),
        ("wait", "300", signal.SIGTERM),
        ("kill -9: recompute", "0", signal.SIGKILL),
    )
    for mode, migrate_after, sig in modes:
        decode_args = ("--drain-timeout", "300", "--drain-migrate-after", migrate_after or "0")
        spec = _spec(model, log_dir, f"bench-migrate-{len(out)}", decode_args)
        with LocalCluster(spec) as cluster:
            if migrate_after is None:
                reference, _ = asyncio.run(_run(cluster, prompts, tokens))
                continue
            exits: list[float] = []

            def act(cluster=cluster, exits=exits, mode=mode, sig=sig) -> None:
                running = {n: cluster.worker_status(n).num_running for n in DECODERS}
                name = max(running, key=running.__getitem__)
                child = cluster.children.pop(name)
                start = time.monotonic()
                child.process.send_signal(sig)
                child.process.wait(timeout=600)
                exits.append(time.monotonic() - start)
                out[mode] = {"streams_on_worker": running[name]}

            got, _ = asyncio.run(_run(cluster, prompts, tokens, act))
            same = sum(g == r for g, r in zip(got, reference, strict=True))
            out[mode].update(exit_s=round(exits[0], 2), identical=same)
        print(f"[scale-down] {mode}: {out[mode]}", flush=True)
    return out


def move_pause(model: str, log_dir: Path, lengths: list[int], repeats: int) -> dict:
    spec = _spec(
        model, log_dir, "bench-move", router_args=("--disaggregation-min-tokens", "100000")
    )
    figures = {}
    with LocalCluster(spec) as cluster:
        for length in lengths:
            pauses, recomputes = [], []
            for r in range(repeats):
                (prompt,) = random_prompts(1, 4096, (length, length), seed=60 + r + length)

                def act() -> None:
                    running = {n: cluster.worker_status(n).num_running for n in DECODERS}
                    name = max(running, key=running.__getitem__)
                    with cluster.worker_channel(name) as channel:
                        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                        stub.Migrate(worker_pb2.MigrateRequest(num_blocks=1), timeout=30)

                (tokens,), (times,) = asyncio.run(_run(cluster, [prompt], 64, act, after=32))
                gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
                pauses.append(max(gaps))
                # A recompute: the same tokens prefilled on a decode worker.
                start = time.monotonic()
                asyncio.run(_run(cluster, [prompt + tokens[:32]], 1))
                recomputes.append(time.monotonic() - start)
            figures[length] = {
                "pause_with_kv_s": round(sorted(pauses)[len(pauses) // 2], 3),
                "recompute_prefill_s": round(sorted(recomputes)[len(recomputes) // 2], 3),
            }
            print(f"[move] prompt {length}: {figures[length]}", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: a random one of --size)")
    parser.add_argument("--size", default="medium", help="preset of the random checkpoint")
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--lengths", default="512,1536")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model = checkpoint(args.model, args.size, "migration")
    log_dir = LOG_DIR
    report = {
        **provenance(args.model, args.size),
        "scale_down": scale_down(model, log_dir, args.streams, args.tokens),
        "move_pause": move_pause(
            model, log_dir, [int(x) for x in args.lengths.split(",")], args.repeats
        ),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
