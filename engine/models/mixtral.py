"""Mixtral: the Mistral decoder with a mixture of experts on every layer (top-k of the
router's softmax, renormalised). The checkpoint calls the block ``block_sparse_moe``
and an expert's projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down); here the block
is the layer's ``mlp`` like every other family's."""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def checkpoint_targets(self, name: str) -> tuple[str, object] | None:
        return super().checkpoint_targets(name.replace(".block_sparse_moe.", ".mlp."))
