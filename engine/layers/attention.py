"""Grouped-query self-attention: fused QKV projection, optional per-head q/k norm
(Qwen3, Gemma 3), rotary, paged attention, output."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        sliding_window: int | None,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        """``qk_norm``: makes the norm (over ``head_dim``) applied to each head of q and of
        k before the rotation; ``None``: none."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.q_norm = None if qk_norm is None else qk_norm(head_dim)
        self.k_norm = None if qk_norm is None else qk_norm(head_dim)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.sliding_window)
        return self.o_proj(out.reshape(n, self.q_size))
