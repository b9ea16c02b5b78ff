"""Mistral: the Llama decoder with sliding-window attention on every layer (each token
sees the ``sliding_window`` most recent positions, itself included). The window comes
from ``config.json`` and is applied by the attention backend's mask."""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same module tree and checkpoint names as Llama; the window is a config value."""
