"""CPU attention: a native paged kernel for decodes and short chunks, SDPA for the rest.

The decode kernel (``csrc/paged_decode.c``) reads each sequence's keys and values
straight from the paged cache through its block table, once, with the query heads of a
GQA group sharing each row. The torch path instead gathers every block into a padded
copy and reads it again in SDPA: three passes over the KV bytes instead of one, plus the
padding to the longest sequence. float32 only; other dtypes use ``SdpaAttention``.

A quantized cache (``kv_quant``) has its own kernel entry point, chosen here once:
``tandem_paged_decode_i8`` / ``_fp8`` read the one-byte codes and their scales in place,
decoding each token-head row once for its whole GQA group (fp8 through a 256-entry table
of torch's own e4m3 values).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.attention.kv_quant import KVCacheDtype, make_kv_codec
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.sdpa import SdpaAttention

KERNEL_CHUNK_TOKENS = 16
"""Prefill chunks of up to this many tokens (speculative verifications, a draft model's
catch-up, short prompts) also run through the decode kernel, one row per query token:
row ``j`` of a chunk starting at position ``p`` is a decode of a sequence of length
``p + j + 1`` sharing the chunk's block table (the chunk's own keys are written to the
cache first). That is causal attention without a mask, and it keeps a verification of
k + 1 tokens about as cheap as a decode instead of taking the SDPA path."""


class CpuPagedAttention(SdpaAttention):
    def __init__(
        self, scale: float, library: ctypes.CDLL, kv_dtype: KVCacheDtype = KVCacheDtype.AUTO
    ) -> None:
        super().__init__(scale, make_kv_codec(kv_dtype))
        self._kernel, self._kernel_tail = _kernel_for(library, kv_dtype)
        self._rows: _KernelRows | None = None
        self._long_spans: list[tuple[int, int, int, int]] = []

    def plan(self, meta: AttentionMetadata) -> None:
        """Split the step once (every layer reuses it): decodes and short chunks go to
        the kernel as rows, longer chunks to SDPA."""
        super().plan(meta)
        query_rows = list(range(meta.num_decodes))
        row_seqs = list(range(meta.num_decodes))
        row_lens = list(meta.seq_lens_list[: meta.num_decodes])
        self._long_spans = []
        for span in meta.prefill_spans():
            seq, q_start, q_end, context_start = span
            if q_end - q_start > KERNEL_CHUNK_TOKENS:
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
        out = torch.empty_like(q)
        rows = self._rows
        if rows is not None:
            if rows.query_rows is None:
                out[: rows.num_rows] = self._run_kernel(
                    q[: rows.num_rows], kv_cache, rows, sliding_window
                )
            else:
                picked = q.index_select(0, rows.query_rows)
                out.index_copy_(
                    0, rows.query_rows, self._run_kernel(picked, kv_cache, rows, sliding_window)
                )
        self._prefill_spans(out, q, k, v, kv_cache, meta, self._long_spans, sliding_window)
        return out

    def _run_kernel(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: _KernelRows,
        sliding_window: int | None,
    ) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        num_rows, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        status = self._kernel(
            q.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
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
            *self._kernel_tail,
        )
        if status != 0:
            raise RuntimeError(
                f"paged decode kernel failed (heads {num_heads}/{num_kv_heads}, dim {head_dim})"
            )
        return out


def _kernel_for(
    library: ctypes.CDLL, kv_dtype: KVCacheDtype
) -> tuple[Callable[..., int], tuple[ctypes.c_void_p, ...]]:
    """The kernel reading ``kv_dtype``, and the arguments it takes after the common ones
    (fp8: the address of its code table, kept alive by the tuple's owner)."""
    if kv_dtype is KVCacheDtype.INT8:
        return library.tandem_paged_decode_i8, ()
    if kv_dtype is KVCacheDtype.FP8:
        table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        return library.tandem_paged_decode_fp8, (_Address(table),)
    return library.tandem_paged_decode_f32, ()


class _Address(ctypes.c_void_p):
    """A tensor's data address as a ctypes argument that keeps the tensor alive."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor.data_ptr())
        self.tensor = tensor


@dataclass(frozen=True)
class _KernelRows:
    """One step's kernel rows: which query rows (``None``: the first ``num_rows``), each
    row's block table and sequence length."""

    query_rows: torch.Tensor | None
    num_rows: int
    table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
