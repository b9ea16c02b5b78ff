"""Latent (MLA) KV against the expanded K/V layout: bytes per token, and the time to
pull a prompt's KV from a prefill worker.

    python bench/mla.py [--tokens 512,2048] [--repeats 5] [--threads N]

Part 1 is arithmetic on the released configs' sizes (bfloat16): what one token's KV
costs per layer and over the model in the latent cache Tandem keeps
(``kv_lora_rank + qk_rope_head_dim`` values per layer) and in the expanded layout a
non-MLA engine would store (per head, a key of ``qk_nope + qk_rope`` and a value of
``v_head_dim``).

Part 2 measures the real pull path (``KVReceiver.pull``: the PullBlocks RPC, the
prefill side gathering blocks from its paged cache and sending them over gloo, the
receive here, then ``unpack_blocks`` into this process's cache) for ``--tokens`` tokens
of a model with DeepSeek-V2-Lite's attention shapes (27 layers, 16 heads, latent 512 +
rope 64; expanded K 192 + V 128 per head, stored as two planes of 160 per head, the
same bytes), bfloat16, 16-token blocks, in both layouts, in the same run. Medians of
``--repeats`` after one warm-up. Writes ``bench/results/mla.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from tandem.kvtransfer.blocks import unpack_blocks
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.testing import RandomKVServer, RandomKVSpec, random_kv_caches

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
BF16 = 2

# (layers, heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim), from the released configs.
MODELS = {
    "DeepSeek-V2-Lite": (27, 16, 512, 128, 64, 128),
    "DeepSeek-V2": (60, 128, 512, 128, 64, 128),
    "DeepSeek-V3": (61, 128, 512, 128, 64, 128),
}


def bytes_per_token(layers: int, heads: int, rank: int, nope: int, rope: int, v: int) -> dict:
    latent = layers * (rank + rope) * BF16
    expanded = layers * heads * (nope + rope + v) * BF16
    return {"latent": latent, "expanded": expanded, "ratio": expanded / latent}


def layouts() -> dict[str, KVLayout]:
    layers, heads, rank, nope, rope, v = MODELS["DeepSeek-V2-Lite"]
    common = {"model": "bench", "num_layers": layers, "block_size": BLOCK, "dtype": torch.bfloat16}
    return {
        "latent": KVLayout(num_kv_heads=1, head_dim=rank + rope, planes=1, **common),
        "expanded": KVLayout(num_kv_heads=heads, head_dim=(nope + rope + v) // 2, **common),
    }


async def pull_times(layout: KVLayout, tokens: int, repeats: int, threads: int | None) -> list:
    blocks = -(-tokens // BLOCK)
    spec = RandomKVSpec(layout, blocks + 1, (tuple(range(1, blocks + 1)),), torch_threads=threads)
    decode_caches = random_kv_caches(layout, blocks + 1, seed=1)
    times = []
    with RandomKVServer(spec) as server:
        receiver = KVReceiver(layout, "bench-decode", "cpu")
        lease = server.lease_ids[0]
        for i in range(1 + repeats):
            started = time.perf_counter()
            packed = await receiver.pull(server.endpoint, lease, list(range(blocks)), 120)
            unpack_blocks(decode_caches, list(range(1, blocks + 1)), packed)
            if i:  # the first pull makes the pair
                times.append(time.perf_counter() - started)
            del packed
        await receiver.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="512,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    table = {name: bytes_per_token(*shape) for name, shape in MODELS.items()}
    print("KV bytes per token (bfloat16, all layers)")
    print(f"{'model':18} {'latent':>10} {'expanded':>12} {'ratio':>7}")
    for name, row in table.items():
        print(f"{name:18} {row['latent']:>10,} {row['expanded']:>12,} {row['ratio']:>6.1f}x")
    pulls = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = {"tokens": tokens}
        for name, layout in layouts().items():
            times = asyncio.run(pull_times(layout, tokens, args.repeats, args.threads))
            blocks = -(-tokens // BLOCK)
            row[name] = {
                "bytes": blocks * layout.bytes_per_block,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
            }
        row["speedup"] = row["expanded"]["median_s"] / row["latent"]["median_s"]
        pulls.append(row)
    print("\nPull + unpack of one prompt's KV (DeepSeek-V2-Lite attention shapes, bfloat16)")
    header = ("tokens", 7), ("latent MB", 10), ("latent ms", 10), ("expanded MB", 12)
    print(" ".join(f"{name:>{width}}" for name, width in header), "expanded ms  speedup")
    for row in pulls:
        lat, exp = row["latent"], row["expanded"]
        print(
            f"{row['tokens']:>7} {lat['bytes'] / 1e6:>10.1f} {lat['median_s'] * 1e3:>10.1f} "
            f"{exp['bytes'] / 1e6:>12.1f} {exp['median_s'] * 1e3:>12.1f} {row['speedup']:>7.1f}x"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
    ).stdout.strip()
    out = REPO_ROOT / "bench" / "results" / "mla.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "bytes_per_token": table,
        "pulls": pulls,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
