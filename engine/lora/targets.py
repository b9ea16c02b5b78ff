"""Where a LoRA adapter can sit in a loaded model, and what slice of it this rank holds.

A *target* is one linear layer of an attention or MLP block, named by its path in the
model (``model.layers.3.self_attn.qkv_proj``). A fused layer stacks several checkpoint
projections along its output (q/k/v, gate/up): each is a *slice* with its own adapter
(PEFT's ``q_proj`` and ``v_proj`` have different A and B), so a target lists its slices
with their full row counts and the rows this rank holds of each. Under tensor
parallelism a column-parallel layer holds a span of each slice's rows (the adapter's B
is cut the same way), and a row-parallel layer holds a span of the input columns (the
adapter's A is cut by columns; the partial products are summed over the ranks).

The scan reads the layers as loading left them, before packing hides their class (a
packed or quantized layer keeps its path, which is what adapters are matched by).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, Span
from tandem.engine.quantization.linear import AllReducedLinear, QuantizedLinear

TARGET_LEAVES = frozenset(
    {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        # latent attention (DeepSeek) keeps these apart
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
    }
)
"""Leaf names of the layers an adapter may target (their checkpoint names, fused or not:
see ``peft_target``)."""


@dataclass(frozen=True)
class OutSlice:
    """One stacked projection of a target's output."""

    full_size: int
    """Its rows in the checkpoint (what an adapter's B must have)."""
    held: Span
    """The rows this rank holds of them (all, without tensor parallelism)."""
    offset: int
    """Where they start in this rank's output."""


@dataclass(frozen=True)
class Target:
    path: str
    in_features: int
    """Full input size (what an adapter's A must have as columns)."""
    in_span: Span | None
    """Row-parallel: the input columns this rank holds; ``None``: all of them."""
    slices: tuple[OutSlice, ...]

    @property
    def out_features(self) -> int:
        """This rank's output size."""
        return sum(s.held.size for s in self.slices)

    @property
    def row_parallel(self) -> bool:
        return self.in_span is not None


def scan_targets(model: nn.Module, config: ModelConfig) -> dict[str, Target]:
    """Every layer of ``model`` (loaded, not yet packed) an adapter may target, by path."""
    targets = {}
    for path, module in model.named_modules():
        leaf = path.rpartition(".")[2]
        if leaf not in TARGET_LEAVES or ".experts." in f"{path}.":
            continue
        target = _target(path, module, config)
        if target is not None:
            targets[path] = target
    return targets


def _target(path: str, module: nn.Module, config: ModelConfig) -> Target | None:
    product = module.product if isinstance(module, AllReducedLinear) else module
    if isinstance(product, QuantizedLinear):
        held, cols = list(product.row_spans), product.col_span
        in_full = product.in_features if cols is None else None
    elif isinstance(product, ColumnParallelLinear):
        held, cols, in_full = list(product.spans), None, product.in_features
    elif isinstance(product, RowParallelLinear):
        held, cols, in_full = [Span(0, product.out_features)], product.span, None
    elif isinstance(product, nn.Linear):
        held, cols, in_full = [Span(0, product.out_features)], None, product.in_features
    else:
        return None
    full_sizes = _slice_sizes(path, config, held)
    if len(held) == 1 < len(full_sizes):  # a whole fused layer: every slice all there
        if held[0].size != sum(full_sizes):
            raise ValueError(f"{path} has {held[0].size} rows, expected {sum(full_sizes)}")
        held = [Span(0, size) for size in full_sizes]
    if in_full is None:  # row-parallel: the full input is the model's, by layer kind
        in_full = _row_parallel_in(path, config)
    slices, offset = [], 0
    for full, span in zip(full_sizes, held, strict=True):
        slices.append(OutSlice(full, span, offset))
        offset += span.size
    return Target(path, in_full, cols, tuple(slices))


def _slice_sizes(path: str, config: ModelConfig, held: list[Span]) -> list[int]:
    """Full rows of each stacked projection of the layer at ``path``."""
    leaf = path.rpartition(".")[2]
    if leaf == "qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    if leaf == "gate_up_proj":
        size = _intermediate(path, config)
        return [size, size]
    if leaf in ("q_proj", "q_b_proj") and config.mla is not None:  # per-head rows
        return [config.num_heads * config.mla.qk_head_dim]
    return [held[0].size]


def _intermediate(path: str, config: ModelConfig) -> int:
    if ".shared_experts." in path and config.moe is not None:
        return config.moe.shared_intermediate_size
    return config.intermediate_size


def _row_parallel_in(path: str, config: ModelConfig) -> int:
    leaf = path.rpartition(".")[2]
    if leaf == "down_proj":
        return _intermediate(path, config)
    if config.mla is not None:  # o_proj of latent attention
        return config.num_heads * config.mla.v_head_dim
    return config.q_size


def peft_target(model: nn.Module, module_path: str) -> tuple[str, int | None]:
    """The target path and slice index (``None``: the whole output) of an adapter's
    module named as in the checkpoint (``model.layers.0.self_attn.k_proj``: the
    ``qkv_proj`` target's slice 1; Phi-3's fused ``qkv_proj``: all its slices)."""
    if ".experts." in f"{module_path}.":
        raise ValueError("LoRA on a mixture's experts is not supported")
    found = model.checkpoint_targets(f"{module_path}.weight")
    if found is None:
        raise ValueError("the model has no such layer")
    param, shard = found
    if isinstance(shard, tuple):
        raise ValueError("LoRA on a mixture's experts is not supported")
    return param.removesuffix(".weight"), shard
