"""Reference paged attention in plain torch: one sequence at a time, explicit softmax.

Slow and obviously right: every key and value is read back from the paged cache through
the sequence's block table (dequantized when the cache is quantized), scores are computed
in float32. The other backends are tested against it.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.kv_quant import FloatKV, KVCodec
from tandem.engine.attention.metadata import AttentionMetadata, gather_kv, visible_keys


class TorchPagedAttention:
    def __init__(
        self, scale: float, kv: KVCodec | None = None, softcap: float | None = None
    ) -> None:
        self.scale = scale
        self.kv = kv or FloatKV()
        self.softcap = softcap

    def plan(self, meta: AttentionMetadata) -> None:
        """Nothing to prepare: every layer recomputes its masks."""

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
        group = q.shape[1] // k.shape[1]
        for i in range(meta.num_seqs):
            q_start, q_end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens_list[i]
            table = meta.block_table[i : i + 1]
            keys = self.kv.read(gather_kv(kv_cache[0], table)[0, :seq_len], q.dtype)
            values = self.kv.read(gather_kv(kv_cache[1], table)[0, :seq_len], q.dtype)
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
            mask = visible_keys(positions, seq_len, sliding_window)
            scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys.float())
            scores = scores * self.scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
        return out
