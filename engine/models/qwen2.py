"""Qwen2: the Llama decoder with biases on the q/k/v projections and, in the small
checkpoints, input and output embeddings tied. Both come from ``config.json``
(``ModelConfig.qkv_bias``, ``tie_word_embeddings``), as does the optional per-layer
sliding window (``use_sliding_window`` + ``max_window_layers``)."""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same module tree and checkpoint names as Llama; the differences are config flags."""
