"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before the rotation
(``ModelConfig.qk_norm``) and a ``head_dim`` of its own (not ``hidden_size / heads``);
no q/k/v biases. Both come from ``config.json``."""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same module tree and checkpoint names as Llama, plus ``self_attn.{q,k}_norm``."""
