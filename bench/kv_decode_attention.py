"""Decode attention time of the CPU backend per KV cache dtype: one layer's forward (write
the new keys/values, attend through the block table) for a batch of decodes.

    python bench/kv_decode_attention.py [--seqs 32] [--context 512] [--threads 1]

Shapes default to the shipped trained model's attention (6 query / 2 KV heads of 32);
``--heads 12 --kv-heads 4 --head-dim 64`` is the medium Llama's. Prints the kernel's
instruction set (``TANDEM_CPU_ISA`` forces one), then milliseconds per forward for
``auto`` (float32), ``int8`` and ``fp8`` (the fastest of ``--rounds`` rounds of
``--repeats`` forwards, the dtypes taking turns, so that load from other processes
disturbs them alike) and each one's ratio to float32.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from tandem.engine.attention.base import AttentionBackendKind, make_backend
from tandem.engine.attention.kv_quant import KVCacheDtype, QuantizedKV
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.native import paged_decode_library

BLOCK = 16


def decode_batch(seqs: int, context: int, heads: int, kv_heads: int, dim: int):
    """Queries, new K/V, a float32 cache and the metadata of ``seqs`` decodes at
    ``context`` tokens each, every sequence in its own run of blocks."""
    per_seq = -(-context // BLOCK)
    table = torch.arange(seqs * per_seq).view(seqs, per_seq)
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=table[:, last // BLOCK] * BLOCK + last % BLOCK,
        block_table=table,
        seq_lens=torch.full((seqs,), context),
        query_start_loc=tuple(range(seqs + 1)),
        seq_lens_list=(context,) * seqs,
        num_decodes=seqs,
        block_size=BLOCK,
    )
    cache = torch.randn(2, seqs * per_seq, BLOCK, kv_heads, dim)
    q = torch.randn(seqs, heads, dim)
    k, v = torch.randn(seqs, kv_heads, dim), torch.randn(seqs, kv_heads, dim)
    return q, k, v, cache, meta


def forward_timer(kind: KVCacheDtype, batch) -> Callable[[int], float]:
    """A function timing ``repeats`` forwards over a ``kind`` cache (seconds per forward)."""
    q, k, v, cache, meta = batch
    if kind.quantized:
        cache = QuantizedKV(kind).quantize(cache)
    backend = make_backend(AttentionBackendKind.CPU, q.shape[-1] ** -0.5, BLOCK, kind)
    backend.plan(meta)
    for _ in range(5):
        backend.forward(q, k, v, cache, meta, None)

    def run(repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            backend.forward(q, k, v, cache, meta, None)
        return (time.perf_counter() - start) / repeats

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernel: {paged_decode_library().tandem_paged_decode_isa().decode()}")
    batch = decode_batch(args.seqs, args.context, args.heads, args.kv_heads, args.head_dim)
    timers = {kind: forward_timer(kind, batch) for kind in KVCacheDtype}
    best = dict.fromkeys(KVCacheDtype, float("inf"))
    for _ in range(args.rounds):
        for kind, run in timers.items():
            best[kind] = min(best[kind], run(args.repeats))
    for kind, seconds in best.items():
        ratio = seconds / best[KVCacheDtype.AUTO]
        print(
            f"{kind.value:5s} {1e3 * seconds:.3f} ms per forward ({args.seqs} x {args.context}"
            f" tokens), {ratio:.2f}x float32"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
