"""Attention with ``torch.nn.functional.scaled_dot_product_attention``.

Prefill chunks run one SDPA call each: a chunk with no cached prefix attends to its own
fresh keys with the built-in causal mask (the fast path); a chunk after a cached prefix
reads its context through the block table with an explicit mask. All decodes of a step
run as one padded SDPA batch whose mask is built once per step and window, then reused
by every layer. With a quantized cache, gathered blocks are dequantized before SDPA and a
chunk's own fresh keys/values go through the same quantize-dequantize round trip.

Soft-capped scores (Gemma 2: ``cap * tanh(scores / cap)`` before the softmax) are beyond
SDPA's fused kernels; such a model's layers take the same inputs through ``_capped``,
the attention written out in torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.kv_quant import FloatKV, KVCodec
from tandem.engine.attention.metadata import AttentionMetadata, gather_kv, visible_keys


class SdpaAttention:
    def __init__(
        self, scale: float, kv: KVCodec | None = None, softcap: float | None = None
    ) -> None:
        self.scale = scale
        self.kv = kv or FloatKV()
        self.softcap = softcap
        self._decode_masks: dict[int | None, torch.Tensor] = {}

    def plan(self, meta: AttentionMetadata) -> None:
        self._decode_masks.clear()

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
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(
                q[: meta.num_decodes], kv_cache, meta, sliding_window
            )
        self._prefill_spans(out, q, k, v, kv_cache, meta, meta.prefill_spans(), sliding_window)
        return out

    def _prefill_spans(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spans: list[tuple[int, int, int, int]],
        sliding_window: int | None,
    ) -> None:
        """Fill ``out`` for each prefill span (``AttentionMetadata.prefill_spans``)."""
        for seq, q_start, q_end, context_start in spans:
            out[q_start:q_end] = self._prefill(
                q[q_start:q_end],
                k[q_start:q_end],
                v[q_start:q_end],
                kv_cache,
                meta,
                seq,
                context_start,
                sliding_window,
            )

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seq: int,
        context_start: int,
        sliding_window: int | None,
    ) -> torch.Tensor:
        seq_len = meta.seq_lens_list[seq]
        mask = None
        if context_start > 0:
            table = meta.block_table[seq : seq + 1]
            k = self.kv.read(gather_kv(kv_cache[0], table)[0, :seq_len], q.dtype)
            v = self.kv.read(gather_kv(kv_cache[1], table)[0, :seq_len], q.dtype)
        else:
            k, v = self.kv.roundtrip(k), self.kv.roundtrip(v)
        if context_start > 0 or (sliding_window is not None and seq_len > sliding_window):
            positions = torch.arange(context_start, seq_len, device=q.device)
            mask = visible_keys(positions, seq_len, sliding_window)
        if mask is None and self.softcap is not None:
            mask = visible_keys(torch.arange(seq_len, device=q.device), seq_len, None)
        # 4-D inputs: torch's fused CPU kernel takes them (with GQA); 3-D ones fall back
        # to the unfused math path, 2.3x slower on a 200-token chunk.
        out = self._attend(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            mask,
        )
        return out[0].transpose(0, 1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``q [B, H, Q, D]``, ``k, v [B, KVH, K, D]``, ``mask`` (True: visible; ``None``:
        causal) → ``[B, H, Q, D]``."""
        if self.softcap is not None:
            return self._capped(q, k, v, mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )

    def _capped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        table = meta.block_table[: meta.num_decodes]
        keys = self.kv.read(gather_kv(kv_cache[0], table), q.dtype).transpose(1, 2)
        values = self.kv.read(gather_kv(kv_cache[1], table), q.dtype).transpose(1, 2)
        mask = self._decode_mask(meta, keys.shape[2], sliding_window)
        return self._attend(q.unsqueeze(2), keys, values, mask).squeeze(2)

    def _decode_mask(
        self, meta: AttentionMetadata, num_keys: int, sliding_window: int | None
    ) -> torch.Tensor:
        """``[num_decodes, 1, 1, num_keys]``, built by the first layer of the step that
        needs it and reused by the others."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            last = meta.seq_lens[: meta.num_decodes] - 1
            mask = visible_keys(last, num_keys, sliding_window)
            mask = mask.view(meta.num_decodes, 1, 1, num_keys)
            self._decode_masks[sliding_window] = mask
        return mask
