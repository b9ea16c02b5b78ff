"""Gemma 2 and Gemma 3 (text): the Llama block shape with Gemma's numerics.

- Embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first, as the
  checkpoints were trained), tied to the output projection.
- Four norms per layer: the attention and the MLP outputs are normalised too before they
  join the residual (``post_attention_layernorm``, ``post_feedforward_layernorm``). All
  are ``GemmaRMSNorm`` (weight stored as an offset from one, product in float32).
- GeGLU MLP (``gelu_pytorch_tanh``).
- Scores scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps them
  (``attn_logit_softcapping``, applied by the attention backend) and the final logits
  (``final_logit_softcapping``).
- Sliding-window and global layers alternate by the config's pattern
  (``ModelConfig.sliding_windows``); Gemma 3 turns its sliding layers with their own
  rope base (``ModelConfig.local_rope``) and norms q and k per head.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.attention.base import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.layers.attention import SelfAttention
from tandem.engine.layers.norm import GemmaRMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models.llama import LlamaForCausalLM, make_mlp


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.sliding_windows[layer_index] is not None
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = SelfAttention(
            d,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.qkv_bias,
            config.sliding_windows[layer_index],
            qk_norm=(lambda dim: GemmaRMSNorm(dim, eps)) if config.qk_norm else None,
        )
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = make_mlp(config, layer_index)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(h), positions, rotary, kv_cache, backend, meta
        )
        h = h + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaStack(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        positions = config.max_position_embeddings
        self.rotary = RotaryEmbedding(
            config.head_dim, positions, config.rope, dtype, rotary_dim=config.rotary_dim
        )
        self.local_rotary = None
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, positions, config.local_rope, dtype, rotary_dim=config.rotary_dim
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            local = layer.sliding and self.local_rotary is not None
            rotary = self.local_rotary if local else self.rotary
            h = layer(h, positions, rotary, kv_cache, backend, meta)
        return self.norm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Checkpoint names as in transformers (``model.layers.{i}.pre_feedforward_layernorm``
    ...); the output projection is the embedding."""

    stack = GemmaStack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is None or logits is None:  # None: a tensor-parallel rank other than 0
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2 plus per-head q/k norms and a local rope base (both from the config)."""
