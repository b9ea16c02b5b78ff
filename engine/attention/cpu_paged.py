"""CPU attention: SDPA for prefill chunks, a native paged kernel for decodes.

The decode kernel (``csrc/paged_decode.c``) reads each sequence's keys and values
straight from the paged cache through its block table, once, with the query heads of a
GQA group sharing each row. The torch path instead gathers every block into a padded
copy and reads it again in SDPA: three passes over the KV bytes instead of one, plus the
padding to the longest sequence. float32 only; other dtypes use ``SdpaAttention``.
"""

from __future__ import annotations

import ctypes

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.sdpa import SdpaAttention


class CpuPagedAttention(SdpaAttention):
    def __init__(self, scale: float, library: ctypes.CDLL) -> None:
        super().__init__(scale)
        self._kernel = library.tandem_paged_decode_f32
        self._max_seq_len = 0

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        decodes = meta.seq_lens_list[: meta.num_decodes]
        self._max_seq_len = max(decodes, default=0)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        table = meta.block_table[: meta.num_decodes]
        status = self._kernel(
            q.data_ptr(),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            table.data_ptr(),
            meta.seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            table.shape[1],
            self._max_seq_len,
            self.scale,
            sliding_window or 0,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(
                f"paged decode kernel failed (heads {num_heads}/{num_kv_heads}, dim {head_dim})"
            )
        return out
