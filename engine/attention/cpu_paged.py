"""CPU attention: a native paged kernel for decodes and chunks of short sequences, SDPA
for the rest.

The decode kernel (``csrc/paged_decode.c``) reads each sequence's keys and values
straight from the paged cache through its block table, once, with the query heads of a
GQA group sharing each row. The torch path instead gathers every block into a padded
copy and reads it again in SDPA: three passes over the KV bytes instead of one, plus the
padding to the longest sequence. float32 only; other dtypes use ``SdpaAttention``.

A quantized cache (``kv_quant``) has its own kernel entry point, chosen here once:
``tandem_paged_decode_i8`` / ``_fp8`` read the one-byte codes and their scales in place,
converting each token-head row in registers once for a tile of up to 4 query heads of
its GQA group. New keys and values are quantized into such a cache by the library too
(``tandem_kv_write_q8``, one pass per token-head row, the same bytes as
``QuantizedKV.quantize``), about a tenth of the torch ops' time at decode sizes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.attention.kv_quant import KVCacheDtype, QuantizedKV, make_kv_codec
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.sdpa import SdpaAttention

KERNEL_CHUNK_TOKENS = 16
"""Prefill chunks of up to this many tokens (speculative verifications, a draft model's
catch-up, short prompts) run through the decode kernel at any context length, one row per
query token: row ``j`` of a chunk starting at position ``p`` is a decode of a sequence of
length ``p + j + 1`` sharing the chunk's block table (the chunk's own keys are written to
the cache first). That is causal attention without a mask, and it keeps a verification of
k + 1 tokens about as cheap as a decode instead of taking the SDPA path."""

KERNEL_SEQ_LEN = 1024
"""Longer chunks run through the kernel too while their sequence (cached context plus
chunk) is at most this long; beyond, SDPA. Measured on 2 AMD EPYC threads, 12 query / 4
KV heads of 64, the kernel's time over SDPA's for one layer: 0.45x (16 prompts of 64),
0.56x (7 of 144), 0.67x (4 of 256 and 2 of 512), 0.82x (one of 1,024), 0.94x (256 after
512 cached); 1.08x for one prompt of 2,048 and 1.13x for 512 after 1,536. A short
sequence's keys and values stay in cache across its rows, so the kernel's single read
beats SDPA's blocked GEMMs (torch's CPU flash attention over MKL, slow on AMD parts)."""


class CpuPagedAttention(SdpaAttention):
    def __init__(
        self,
        scale: float,
        library: ctypes.CDLL,
        kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant``: every chunk through the kernel, whatever its length: a
        query row is then computed as a decode over its own keys, the same way whether
        it is a decode, a row of a prompt chunk or of a recomputed prompt, whatever else
        the step holds (the kernel never splits one row's key range)."""
        codec = NativeQuantizedKV(kv_dtype, library) if kv_dtype.quantized else None
        super().__init__(scale, codec or make_kv_codec(kv_dtype), softcap=None)
        self.batch_invariant = batch_invariant
        self._kernel = _kernel_for(library, kv_dtype)
        self._rows: _KernelRows | None = None
        self._long_spans: list[tuple[int, int, int, int]] = []

    def plan(self, meta: AttentionMetadata) -> None:
        """Split the step once (every layer reuses it): decodes, short chunks and chunks
        of short sequences go to the kernel as rows, the other chunks to SDPA."""
        super().plan(meta)
        query_rows = list(range(meta.num_decodes))
        row_seqs = list(range(meta.num_decodes))
        row_lens = list(meta.seq_lens_list[: meta.num_decodes])
        self._long_spans = []
        for span in meta.prefill_spans():
            seq, q_start, q_end, context_start = span
            chunk = q_end - q_start
            long = chunk > KERNEL_CHUNK_TOKENS and context_start + chunk > KERNEL_SEQ_LEN
            if long and not self.batch_invariant:
                self._long_spans.append(span)
                continue
            query_rows.extend(range(q_start, q_end))
            row_seqs.extend([seq] * (q_end - q_start))
            row_lens.extend(range(context_start + 1, context_start + q_end - q_start + 1))
        self._rows = None
        if query_rows:
            device = meta.block_table.device
            contiguous = query_rows == list(range(len(query_rows)))
            self._rows = _KernelRows(
                query_rows=None if contiguous else torch.tensor(query_rows, device=device),
                num_rows=len(query_rows),
                table=meta.block_table[torch.tensor(row_seqs, device=device)],
                seq_lens=torch.tensor(row_lens, dtype=torch.int64, device=device),
                max_seq_len=max(row_lens),
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        self.kv.write(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
        rows = self._rows
        if rows is not None:
            if rows.query_rows is None:  # the kernel writes the first rows of `out` itself
                self._run_kernel(q[: rows.num_rows], kv_cache, rows, sliding_window, out)
            else:
                picked = q.index_select(0, rows.query_rows)
                attended = self._run_kernel(
                    picked, kv_cache, rows, sliding_window, torch.empty_like(picked)
                )
                out.index_copy_(0, rows.query_rows, attended)
        self._prefill_spans(out, q, k, v, kv_cache, meta, self._long_spans, sliding_window)
        return out

    def _run_kernel(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: _KernelRows,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attends ``q [rows, H, D]`` into the first ``rows`` rows of ``out`` (contiguous)
        and returns ``out``."""
        q = q.contiguous()
        num_rows, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        k_cache, v_cache = _halves(kv_cache)
        status = self._kernel(
            q.data_ptr(),
            k_cache,
            v_cache,
            rows.table.data_ptr(),
            rows.seq_lens.data_ptr(),
            out.data_ptr(),
            num_rows,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            rows.table.shape[1],
            rows.max_seq_len,
            self.scale,
            sliding_window or 0,
            torch.get_num_threads(),
        )
        if status != 0:
            why = "head_dim beyond the kernel's" if status == -2 else "out of memory"
            raise RuntimeError(
                f"paged decode kernel failed: {why} (heads {num_heads}/{num_kv_heads}, "
                f"dim {head_dim})"
            )
        return out


def _kernel_for(library: ctypes.CDLL, kv_dtype: KVCacheDtype) -> Callable[..., int]:
    """The kernel entry point reading a ``kv_dtype`` cache."""
    if kv_dtype is KVCacheDtype.INT8:
        return library.tandem_paged_decode_i8
    if kv_dtype is KVCacheDtype.FP8:
        return library.tandem_paged_decode_fp8
    return library.tandem_paged_decode_f32


def _halves(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of ``kv_cache[0]`` and ``kv_cache[1]`` (without making the two views)."""
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(0) * kv_cache.element_size()


class NativeQuantizedKV(QuantizedKV):
    """``QuantizedKV`` whose writes run in the native library: the same bytes (tested
    against the torch ops), in one pass instead of a dozen torch calls per layer."""

    def __init__(self, kind: KVCacheDtype, library: ctypes.CDLL) -> None:
        super().__init__(kind)
        self._write = library.tandem_kv_write_q8
        self._fp8 = int(kind is KVCacheDtype.FP8)

    def write(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if not kv_cache.is_contiguous():
            super().write(kv_cache, k, v, slots)
            return
        k, v = _token_rows(k), _token_rows(v)
        slots = slots.to(torch.int64).contiguous()
        k_cache, v_cache = _halves(kv_cache)
        self._write(
            self._fp8,
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            slots.data_ptr(),
            k.shape[0],
            k.shape[1],
            k.shape[2],
            k_cache,
            v_cache,
            torch.get_num_threads(),
        )


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [T, KVH, D]`` as float32 with each token's heads contiguous (tokens may be any
    stride apart, as in a view of the fused QKV projection's output)."""
    x = x.float()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


@dataclass(frozen=True)
class _KernelRows:
    """One step's kernel rows: which query rows (``None``: the first ``num_rows``), each
    row's block table and sequence length."""

    query_rows: torch.Tensor | None
    num_rows: int
    table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
