"""Multi-turn chat: how much of a conversation's earlier turns is served from cache, and
the time to first token of later turns, with conditional disaggregation (the default)
and without it (``--max-local-prefill-tokens 0``: every prompt prefilled by the prefill
pool, as before), in the same run.

    python bench/multiturn.py [--model DIR] [--size medium] [--json PATH]

Each mode gets a fresh cluster of 2 prefill + 2 decode workers (bfloat16, one thread
each). ``--conversations`` conversations run at once, each ``--turns`` turns: a turn's
prompt is the whole history (user turns and answers) plus a new user turn of 64-128
tokens; answers are ``--answer`` greedy tokens; 0.5 s of "reading" between turns.
Reported, over turns 2 and later: the share of the earlier turns' tokens (the history
in the prompt) that the cluster did not compute (``usage.cached_prompt_tokens``), and
TTFT p50 / p90.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

from tandem.bench.cluster_bench import LOG_DIR, checkpoint, emit, free_port, provenance
from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.protos import common_pb2


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _conversation(
    client: AsyncGenerationClient, rng: random.Random, turns: int, answer: int
) -> list[tuple[int, int, float]]:
    """Per turn after the first: (earlier tokens, cached tokens, TTFT)."""
    greedy = common_pb2.SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    history: list[int] = []
    figures = []
    for turn in range(turns):
        user = [rng.randrange(10, 4096) for _ in range(rng.randint(64, 128))]
        prompt = history + user
        tokens: list[int] = []
        start, ttft, cached = time.monotonic(), None, 0
        async for response in client.generate(build_request(prompt, greedy), timeout_s=300):
            if ttft is None and response.token_ids:
                ttft = time.monotonic() - start
            tokens += response.token_ids
            if response.HasField("usage"):
                cached = response.usage.cached_prompt_tokens
        if turn:
            figures.append((len(history), cached, ttft))
        history = prompt + tokens
        await asyncio.sleep(0.5)
    return figures


def run_mode(model: str, log_dir: Path, name: str, router_args: tuple, args) -> dict:
    spec = ClusterSpec(
        model_dir=model,
        num_prefill=2,
        num_decode=2,
        router_port=free_port(),
        model_name=name,
        worker_args=("--dtype", "bfloat16", "--num-kv-blocks", "2048", "--max-model-len", "2048"),
        router_args=router_args,
        threads_per_worker=1,
        log_dir=log_dir,
    )
    with LocalCluster(spec) as cluster:

        async def everyone() -> list[list[tuple[int, int, float]]]:
            async with AsyncGenerationClient(cluster.router_address) as client:
                return await asyncio.gather(
                    *(
                        _conversation(client, random.Random(i), args.turns, args.answer)
                        for i in range(args.conversations)
                    )
                )

        figures = [f for conv in asyncio.run(everyone()) for f in conv]
    earlier = sum(f[0] for f in figures)
    cached = sum(f[1] for f in figures)
    ttfts = [f[2] for f in figures]
    return {
        "later_turns": len(figures),
        "earlier_tokens": earlier,
        "cached_tokens": cached,
        "cached_share": round(cached / earlier, 3),
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 3),
        "ttft_p90_s": round(_percentile(ttfts, 0.9), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: a random one of --size)")
    parser.add_argument("--size", default="medium", help="preset of the random checkpoint")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model = checkpoint(args.model, args.size, "multiturn")
    log_dir = LOG_DIR
    modes = {
        "always remote (before)": ("--max-local-prefill-tokens", "0"),
        "conditional": (),
    }
    report = {
        **provenance(args.model, args.size),
        "workload": f"{args.conversations} conversations x {args.turns} turns, "
        f"{args.answer}-token answers, 64-128-token user turns",
    }
    for i, (mode, router_args) in enumerate(modes.items()):
        report[mode] = run_mode(model, log_dir, f"bench-turns-{i}", router_args, args)
        print(f"[multi-turn] {mode}: {report[mode]}", flush=True)
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
