"""Dense causal attention over a batch of equal-length sequences, with no KV cache.

For training and scoring whole windows: a ``[B, T]`` batch of token ids is run through
the engine's model flattened to ``B * T`` tokens, sequence after sequence, each starting
at position 0 (``dense_batch_metadata``). Every sequence attends causally to itself
(within the layer's sliding window, if any) in one batched SDPA call; nothing is read
from or written to a cache, so the model's per-layer ``kv_cache`` arguments are never
touched (``NO_KV_CACHE`` fits) and autograd sees plain tensor ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttentionMetadata, visible_keys

NO_KV_CACHE = torch.empty(2, 0, 1, 1, 1)
"""A KV cache of zero blocks: what each layer gets when its backend keeps no cache."""


def dense_batch_metadata(
    batch_size: int, seq_len: int, device: torch.device | None = None
) -> AttentionMetadata:
    """``batch_size`` prefill sequences of ``seq_len`` tokens from position 0, laid out
    as in a cache of ``batch_size`` blocks of ``seq_len`` slots (sequence ``i`` in block
    ``i``), so a paged backend given such a cache computes the same attention."""
    n = batch_size * seq_len
    return AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_table=torch.arange(batch_size, device=device).unsqueeze(1),
        seq_lens=torch.full((batch_size,), seq_len, device=device),
        query_start_loc=tuple(range(0, n + 1, seq_len)),
        seq_lens_list=(seq_len,) * batch_size,
        num_decodes=0 if seq_len > 1 else batch_size,
        block_size=seq_len,
    )


class DenseCausalAttention:
    """An ``AttentionBackend`` for batches ``dense_batch_metadata`` describes."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def plan(self, meta: AttentionMetadata) -> None:
        """Refuse a batch that is not equal-length sequences from position 0."""
        seq_len = meta.seq_lens_list[0]
        starts = tuple(range(0, seq_len * meta.num_seqs + 1, seq_len))
        if set(meta.seq_lens_list) != {seq_len} or meta.query_start_loc != starts:
            raise ValueError("dense attention needs equal-length sequences from position 0")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``q [B*T, H, D]``, ``k, v [B*T, KVH, D]`` → ``[B*T, H, D]``; ``kv_cache`` unused.
        ``q`` and ``k`` are cast to ``v``'s dtype (under autocast, rotary tables may be
        wider than the projections)."""
        b, t, dtype = meta.num_seqs, meta.seq_lens_list[0], v.dtype
        q, k, v = (x.view(b, t, *x.shape[1:]).transpose(1, 2).to(dtype) for x in (q, k, v))
        mask = None
        if sliding_window is not None and t > sliding_window:
            mask = visible_keys(torch.arange(t, device=q.device), t, sliding_window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )
        return out.transpose(1, 2).flatten(0, 1)
