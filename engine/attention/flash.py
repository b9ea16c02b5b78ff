"""FlashAttention-2 over the paged cache (CUDA only; selected when ``flash_attn`` imports).

One ``flash_attn_varlen_func`` call per layer covers decodes and prefill chunks alike:
the kernel reads keys through ``block_table`` and aligns the causal mask bottom-right, so
a chunk after a cached prefix needs nothing special. Upstream flash-attn requires the
paged block size to be a multiple of 256, which is why the engine picks 256-token blocks
when this backend is chosen.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.base import write_kv
from tandem.engine.attention.metadata import AttentionMetadata

FLASH_BLOCK_SIZE_MULTIPLE = 256


class FlashAttention:
    def __init__(self, scale: float, block_size: int, softcap: float | None = None) -> None:
        if block_size % FLASH_BLOCK_SIZE_MULTIPLE:
            raise ValueError(
                f"block_size {block_size} is not a multiple of {FLASH_BLOCK_SIZE_MULTIPLE}, "
                "which flash-attn's paged kernels require"
            )
        from flash_attn import flash_attn_varlen_func

        self._kernel = flash_attn_varlen_func
        self.scale = scale
        self.softcap = softcap or 0.0  # flash-attn's 0.0: no capping
        self._cu_q: torch.Tensor | None = None
        self._cu_k: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._max_q = self._max_k = 0

    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        starts = meta.query_start_loc
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
        self._cu_q = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
        self._cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=device)
        self._cu_k[1:] = meta.seq_lens.cumsum(0)
        self._table = meta.block_table.to(torch.int32)
        self._max_q, self._max_k = max(q_lens), max(meta.seq_lens_list)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return self._kernel(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=self._cu_q,
            cu_seqlens_k=self._cu_k,
            max_seqlen_q=self._max_q,
            max_seqlen_k=self._max_k,
            softmax_scale=self.scale,
            causal=True,
            window_size=window,
            softcap=self.softcap,
            block_table=self._table,
        )
