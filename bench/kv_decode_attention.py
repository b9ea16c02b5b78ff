"""Decode attention time of the CPU backend per KV cache dtype: one layer's forward (write
the new keys/values, attend through the block table) for a batch of decodes.

    python bench/kv_decode_attention.py [--seqs 32] [--context 512] [--threads 1]

Shapes default to the shipped trained model's attention (6 query / 2 KV heads of 32).
Prints milliseconds per forward for ``auto`` (float32), ``int8`` and ``fp8``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tandem.engine.attention.base import AttentionBackendKind, make_backend
from tandem.engine.attention.kv_quant import KVCacheDtype, QuantizedKV
from tandem.engine.attention.metadata import AttentionMetadata

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


def time_forward(kind: KVCacheDtype, batch, repeats: int) -> float:
    q, k, v, cache, meta = batch
    if kind.quantized:
        cache = QuantizedKV(kind).quantize(cache)
    backend = make_backend(AttentionBackendKind.CPU, q.shape[-1] ** -0.5, BLOCK, kind)
    backend.plan(meta)
    for _ in range(5):
        backend.forward(q, k, v, cache, meta, None)
    start = time.perf_counter()
    for _ in range(repeats):
        backend.forward(q, k, v, cache, meta, None)
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = decode_batch(args.seqs, args.context, args.heads, args.kv_heads, args.head_dim)
    for kind in KVCacheDtype:
        ms = 1e3 * time_forward(kind, batch, args.repeats)
        print(f"{kind.value:5s} {ms:.3f} ms per forward ({args.seqs} x {args.context} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
