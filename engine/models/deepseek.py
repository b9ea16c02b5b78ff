"""DeepSeek-V2 and V3: multi-head latent attention and a mixture of experts with shared
experts, in the Llama block shape (pre-norms, residual adds).

- Attention: ``layers.mla`` (queries through a low-rank ``q_a_proj`` / ``q_b_proj``
  when ``q_lora_rank`` is set, else one ``q_proj``; keys and values from a cached latent,
  never expanded); rope on ``qk_rope_head_dim`` dims paired as neighbours, YaRN's
  ``mscale_all_dim`` folded into the softmax scale (``ModelConfig.attention_scale``).
- MLP: dense on the first ``first_k_dense_replace`` layers, else ``layers.moe.SparseMoE``
  with the family's routing (``ModelConfig.moe``: V2 softmax, greedy or from the best
  groups; V3 sigmoid with ``e_score_correction_bias`` for the choice, groups scored by
  their two best experts, weights renormalised when ``norm_topk_prob``; both scaled by
  ``routed_scaling_factor``) and ``n_shared_experts`` shared experts every token runs.
- Checkpoint names are HF's: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj``, ``mlp.gate`` (+
  ``.e_score_correction_bias``), ``mlp.experts.{e}.*`` or stacked, ``mlp.shared_experts.*``.
  V3's multi-token-prediction layers (indices past ``num_hidden_layers``) are not used.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.layers.mla import MultiLatentAttention
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models.llama import DecoderLayer, DecoderStack, LlamaForCausalLM, make_mlp


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        nn.Module.__init__(self)
        eps, mla = config.rms_norm_eps, config.mla
        assert mla is not None
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = MultiLatentAttention(
            config.hidden_size, config.num_heads, mla, config.qkv_bias, eps
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = make_mlp(config, layer_index)


class DeepseekStack(DecoderStack):
    layer = DeepseekDecoderLayer

    @staticmethod
    def make_rotary(config: ModelConfig, dtype: torch.dtype) -> RotaryEmbedding:
        mla = config.mla
        assert mla is not None
        return RotaryEmbedding(
            mla.qk_rope_head_dim,
            config.max_position_embeddings,
            config.rope,
            dtype,
            interleaved=mla.interleaved_rope,
        )


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    stack = DeepseekStack

    def checkpoint_targets(self, name: str) -> tuple[str, object] | None:
        if name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            if index.isdigit() and int(index) >= self.config.num_layers:
                return None  # V3's multi-token-prediction layer(s)
        if ".self_attn." in name:
            return name, None  # no fused projections in MLA
        return super().checkpoint_targets(name)

    def shard_sizes(self, fused_name: str) -> list[int]:
        if ".shared_experts." in fused_name:
            moe = self.config.moe
            assert moe is not None
            return [moe.shared_intermediate_size] * 2
        return super().shard_sizes(fused_name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's module tree; the differences (routing, rope layout) are config values."""
