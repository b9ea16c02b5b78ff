"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a mixture of experts in place
of the MLP on every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``
(``ModelConfig.moe``); the router's top-k weights are renormalised only with
``norm_topk_prob``. Checkpoint names are Llama's plus ``mlp.gate`` (the router) and
``mlp.experts.{e}.{gate,up,down}_proj`` (``layers.moe``)."""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """The Llama module tree with ``layers.moe.SparseMoE`` as the sparse layers' ``mlp``."""
