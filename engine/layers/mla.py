"""Multi-head latent attention (DeepSeek-V2/V3), computed on the latent.

Per token the layer makes one compressed latent ``c`` (``kv_lora_rank`` values,
RMS-normed) and one rotated key ``k_rope`` shared by all heads; HF's model expands them
into per-head keys ``[W_UK_h c | k_rope]`` and values ``W_UV_h c`` (``kv_b_proj``). This
layer never expands them: ``W_UK_h`` is absorbed into the query (``q_nope_h W_UK_h``,
a latent-sized query), so scores are taken against the cached ``[c | k_rope]`` rows
directly, and ``W_UV_h`` is applied to each head's attention-weighted latent after the
softmax. The cache (``attention.latent``) thus holds ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer, for all heads together.

Tensor parallelism splits the heads (``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` by
column, ``o_proj`` by row); the latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, the
norms) is replicated, and every rank caches the same latent rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.common.model_config import MLAConfig
from tandem.engine.attention.base import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tandem.engine.parallel.layers import CheckpointSlice


class LatentProjection(nn.Module):
    """``kv_b_proj``: ``weight [heads * (qk_nope + v), kv_lora_rank]`` as HF stores it,
    used as two per-head factors (keys' ``W_UK``, values' ``W_UV``) rather than as a
    linear layer, so packing and quantization leave it alone."""

    def __init__(self, num_heads: int, mla: MLAConfig) -> None:
        super().__init__()
        self.num_heads, self.first_head = num_heads, 0
        self.nope, self.v = mla.qk_nope_head_dim, mla.v_head_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (self.nope + self.v), mla.kv_lora_rank))

    def shard(self, first_head: int, num_heads: int) -> None:
        """Keep heads ``[first_head, first_head + num_heads)`` (on the meta device)."""
        self.first_head, self.num_heads = first_head, num_heads
        rank = self.weight.shape[1]
        self.weight = nn.Parameter(torch.empty(num_heads * (self.nope + self.v), rank))

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        per_head = self.nope + self.v
        rows = tensor.rows(self.first_head * per_head, self.num_heads * per_head)
        if rows.shape != self.weight.shape:
            raise ValueError(
                f"kv_b_proj has shape {tuple(tensor.shape)} in the checkpoint; this layer "
                f"expects {self.num_heads} heads of {per_head} rows over a latent of "
                f"{self.weight.shape[1]} (config.json's MLA sizes?)"
            )
        self.weight.data.copy_(rows)

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_head = self.weight.view(self.num_heads, self.nope + self.v, -1)
        return per_head[:, : self.nope], per_head[:, self.nope :]  # [H, nope, r], [H, v, r]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, nope]`` → ``[T, H, kv_lora_rank]``: ``q_nope_h @ W_UK_h``."""
        w_uk, _ = self._factors()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, latent: torch.Tensor) -> torch.Tensor:
        """``latent [T, H, kv_lora_rank]`` → ``[T, H * v_head_dim]``: ``W_UV_h`` applied."""
        _, w_uv = self._factors()
        out = torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(latent.shape[0], -1)


class MultiLatentAttention(nn.Module):
    def __init__(
        self, hidden_size: int, num_heads: int, mla: MLAConfig, bias: bool, eps: float
    ) -> None:
        super().__init__()
        self.mla, self.num_heads = mla, num_heads
        qk = mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, mla.cache_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = LatentProjection(num_heads, mla)
        self.o_proj = nn.Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, n = self.mla, x.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = rotary(positions, q_rope.contiguous(), k_rope.reshape(n, 1, -1))
        query = torch.cat([self.kv_b_proj.absorb_query(q_nope), q_rope], dim=-1)
        row = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)  # [T, 1, cache_width]
        out = backend.forward(query, row, None, kv_cache, meta, None)  # [T, H, latent]
        return self.o_proj(self.kv_b_proj.expand_output(out))
