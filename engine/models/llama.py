"""The Llama decoder: pre-norm blocks of grouped-query attention and a SwiGLU MLP.

The family's variants are config values read here, not subclasses of the layers: a q/k
norm per head (Qwen3), a partial rotation (Phi-3), a mixture of experts in place of the
MLP on the layers the config names (Mixtral, Qwen3-MoE: ``layers.moe``).

Runs a flattened batch: ``input_ids [T]`` of all scheduled tokens of all sequences, with
``positions [T]``; attention finds each token's sequence through the metadata. The module
tree mirrors HuggingFace's so checkpoint names map one to one, except that q/k/v and
gate/up are fused into single matrices at load time (one matmul instead of three/two).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.attention.base import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.layers.attention import SelfAttention
from tandem.engine.layers.mlp import GatedMLP
from tandem.engine.layers.moe import GATE, UP, SparseMoE
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tandem.engine.loader import CheckpointTensor

# Checkpoint tensor suffix -> (fused parameter suffix, shard index).
FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Per-expert checkpoint tensor -> (stacked parameter, half of gate_up_proj): the HF hub's
# Qwen3-MoE names and Mixtral's w1 / w3 / w2.
EXPERT_SHARDS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", GATE),
    "up_proj": ("gate_up_proj", UP),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", GATE),
    "w3": ("gate_up_proj", UP),
    "w2": ("down_proj", 0),
}


def make_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """The layer's feed-forward block: a mixture of experts where the config says so."""
    moe = config.moe
    if moe is not None and moe.sparse_layers[layer_index]:
        return SparseMoE(config.hidden_size, moe, config.hidden_act)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.qkv_bias,
            config.sliding_windows[layer_index],
            qk_norm=(lambda dim: RMSNorm(dim, eps)) if config.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = make_mlp(config, layer_index)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm.forward_with_residual(h, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, backend, meta)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class DecoderStack(nn.Module):
    layer: type[nn.Module] = DecoderLayer
    """The block of each layer (a family with another attention names its own)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = self.make_rotary(config, dtype)

    @staticmethod
    def make_rotary(config: ModelConfig, dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope,
            dtype,
            rotary_dim=config.rotary_dim,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, self.rotary, kv_cache, backend, meta)
        h, _ = self.norm.forward_with_residual(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    stack: type[nn.Module] = DecoderStack
    """The decoder under ``model`` (a family with other blocks names its own)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = self.stack(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of every scheduled token."""
        return self.model(input_ids, positions, kv_caches, backend, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_targets(self, name: str) -> tuple[str, object] | None:
        """Where checkpoint tensor ``name`` goes: ``(parameter name, shard or None)``, or
        ``None`` for tensors this model does not use. A shard is an index into a fused
        parameter's stacked tensors, or ``(expert, half)`` for an expert's tensor."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if ".experts." in name:
            return _expert_target(name)
        prefix, _, leaf = name.rpartition(".")
        module_path, _, proj = prefix.rpartition(".")
        if proj in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[proj]
            return f"{module_path}.{fused}.{leaf}", shard
        return name, None

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Row sizes of the shards stacked in a fused parameter."""
        c = self.config
        if ".qkv_proj." in fused_name:
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the names of the filled ones
        (a fused parameter counts once all its shards arrived). A layer that holds a
        slice (tensor parallelism: ``load_slice``) reads only its slice."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        shards_seen: dict[str, set[int]] = {}
        filled: set[str] = set()
        for name, tensor in tensors:
            target = self.checkpoint_targets(name)
            if target is None:
                continue
            param_name, shard = target
            param = params.get(param_name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            module_name, _, leaf = param_name.rpartition(".")
            module = modules[module_name]
            load_slice = getattr(module, "load_slice", None)
            if load_slice is not None:
                load_slice(leaf, tensor, shard)
            else:
                self._load_whole(name, param.data, param_name, shard, tensor)
            is_filled = getattr(module, "is_filled", None)
            if is_filled is not None:  # a module that counts its own pieces (experts)
                if is_filled(leaf):
                    filled.add(param_name)
                continue
            if shard is None:
                filled.add(param_name)
                continue
            shards_seen.setdefault(param_name, set()).add(shard)
            if len(shards_seen[param_name]) == len(self.shard_sizes(param_name)):
                filled.add(param_name)
        return filled

    def _load_whole(
        self,
        name: str,
        dest: torch.Tensor,
        param_name: str,
        shard: int | None,
        tensor: CheckpointTensor,
    ) -> None:
        if shard is not None:
            sizes = self.shard_sizes(param_name)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor.full())


def _expert_target(name: str) -> tuple[str, object]:
    """``...{mlp|block_sparse_moe}.experts.{e}.{proj}.weight`` (per expert) or
    ``...experts.{gate_up_proj|down_proj}`` (stacked, as transformers 5 keeps them)."""
    head, _, tail = name.partition(".experts.")
    layer, _, block = head.rpartition(".")
    target = f"{layer}.mlp.experts"  # Mixtral's block_sparse_moe is this model's mlp
    if block not in ("mlp", "block_sparse_moe"):
        raise ValueError(f"checkpoint tensor {name!r} has no place in a mixture-of-experts model")
    if tail in ("gate_up_proj", "down_proj"):
        return f"{target}.{tail}", None
    expert, _, rest = tail.partition(".")
    proj = rest.removesuffix(".weight")
    if not expert.isdigit() or proj not in EXPERT_SHARDS or not rest.endswith(".weight"):
        raise ValueError(f"checkpoint tensor {name!r} is not an expert weight this model knows")
    stacked, half = EXPERT_SHARDS[proj]
    return f"{target}.{stacked}", (int(expert), half)
