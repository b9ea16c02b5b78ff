"""Attention over a latent paged cache (multi-head latent attention, DeepSeek-V2/V3).

The cache of an MLA layer holds one row per token, ``[kv_lora_rank latent | rotated
key]``, shared by every head: ``[1, num_blocks, block_size, 1, width]`` (one plane, not
K and V). The model absorbs the per-head key and value projections into the query and
the output (``layers.mla``), so attention itself is multi-query attention where

- the query of head ``h`` is ``[W_UK_h^T q_nope_h | q_rope_h]`` (width ``width``),
- every head's key is the cached row,
- every head's value is the row's latent part (its first ``value_dim`` entries),

and a head's output is a latent, turned into ``v_head_dim`` values by ``W_UV_h``
afterwards. Scores equal those of the expanded form (per-head K and V rebuilt from the
latent) up to rounding; the cache is ``width`` values per token and layer instead of
``heads * (qk_head_dim + v_head_dim)``.

One implementation serves decode and prefill: decodes of a step as one padded SDPA
batch (the mask built once per step), each prefill chunk as one SDPA call over its
context read back through the block table (its fresh rows straight, without a first
chunk's cache read). ``reference=True`` is the per-sequence explicit softmax the other
backends are tested against. A quantized cache (int8 / fp8) stores each row's codes
with one scale; attention reads the dequantized rows, fresh ones included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.kv_quant import KVCodec
from tandem.engine.attention.metadata import AttentionMetadata, gather_kv, visible_keys


class LatentAttention:
    def __init__(self, scale: float, value_dim: int, kv: KVCodec, reference: bool = False) -> None:
        self.scale = scale
        self.value_dim = value_dim
        self.kv = kv
        self.reference = reference
        self._decode_mask: torch.Tensor | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        self._decode_mask = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``q [T, H, width]`` (absorbed queries), ``k [T, 1, width]`` (new cache rows),
        ``v`` unused (the values are the rows' latents) → ``[T, H, value_dim]``."""
        if sliding_window is not None:
            raise ValueError("latent attention has no sliding window")
        self.kv.write_plane(kv_cache[0], k, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], self.value_dim)
        if self.reference:
            for i in range(meta.num_seqs):
                start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
                out[start:end] = self._reference(q[start:end], kv_cache, meta, i)
            return out
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta)
        for seq, start, end, context_start in meta.prefill_spans():
            out[start:end] = self._prefill(
                q[start:end], k[start:end], kv_cache, meta, seq, context_start
            )
        return out

    def _rows(
        self, kv_cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``[N, B * block_size, 1, width]`` dequantized rows of the sequences in ``table``."""
        return self.kv.read(gather_kv(kv_cache[0], table), dtype)

    def _attend(
        self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``q [B, H, Q, width]``, ``rows [B, 1, K, width]`` → ``[B, H, Q, value_dim]``."""
        return F.scaled_dot_product_attention(
            q,
            rows,
            rows[..., : self.value_dim],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        table = meta.block_table[: meta.num_decodes]
        rows = self._rows(kv_cache, table, q.dtype).transpose(1, 2)  # [N, 1, K, width]
        if self._decode_mask is None:  # the first layer of the step builds it
            last = meta.seq_lens[: meta.num_decodes] - 1
            num_keys = rows.shape[2]
            mask = visible_keys(last, num_keys, None)
            self._decode_mask = mask.view(meta.num_decodes, 1, 1, num_keys)
        return self._attend(q.unsqueeze(2), rows, self._decode_mask).squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        fresh: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seq: int,
        context_start: int,
    ) -> torch.Tensor:
        seq_len = meta.seq_lens_list[seq]
        mask = None
        if context_start > 0:
            rows = self._rows(kv_cache, meta.block_table[seq : seq + 1], q.dtype)[0, :seq_len]
            positions = torch.arange(context_start, seq_len, device=q.device)
            mask = visible_keys(positions, seq_len, None)
        else:
            rows = self.kv.roundtrip(fresh)
        out = self._attend(q.transpose(0, 1).unsqueeze(0), rows.transpose(0, 1).unsqueeze(0), mask)
        return out[0].transpose(0, 1)

    def _reference(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int
    ) -> torch.Tensor:
        """Explicit float32 softmax over the sequence's rows read through its block table."""
        seq_len = meta.seq_lens_list[seq]
        rows = self._rows(kv_cache, meta.block_table[seq : seq + 1], q.dtype)[0, :seq_len, 0]
        positions = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
        mask = visible_keys(positions, seq_len, None)
        scores = torch.einsum("qhd,kd->hqk", q.float(), rows.float()) * self.scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        values = rows[:, : self.value_dim].float()
        return torch.einsum("hqk,kd->qhd", probs, values).to(q.dtype)
