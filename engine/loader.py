"""Build a model from a HuggingFace checkpoint directory (``*.safetensors``).

The model is constructed on the meta device (no random init, no memory), split into
this rank's slice when tensor-parallel (``parallel.shard.shard_model``), materialised on
the target device, then every parameter is filled from the memory-mapped safetensors
files: a parallel layer reads only its rows or columns of a tensor, so a rank's resident
memory holds its slice of the weights, not all of them. A checkpoint that leaves any
parameter unfilled is refused with the missing names; nothing half-loaded is returned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.common.checkpoint_files import open_safetensors, safetensors_files
from tandem.common.model_config import ModelConfig
from tandem.engine.layers.moe import ExpertSplit
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models import model_class
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.engine.parallel.shard import shard_model
from tandem.engine.quantization.checkpoint import load_quantized, stored_quantization
from tandem.engine.quantization.linear import QuantizedLinear, quantize_experts, quantize_model
from tandem.engine.quantization.scheme import QuantizationConfig


class CheckpointTensor:
    """One tensor of a safetensors file, read only as far as asked (memory-mapped)."""

    def __init__(self, handle: Any) -> None:
        self._slice = handle

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def full(self) -> torch.Tensor:
        return self._slice[:]

    def rows(self, start: int, size: int) -> torch.Tensor:
        return self._slice[start : start + size]

    def cols(self, start: int, size: int) -> torch.Tensor:
        return self._slice[:, start : start + size]


def iter_checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint's weight files (``safetensors_files``: the shards
    its index names, when it has one)."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, CheckpointTensor(f.get_slice(name))


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    quantization: QuantizationConfig | None = None,
    expert_split: ExpertSplit = ExpertSplit.TENSOR,
) -> nn.Module:
    """``tp``: this rank's group when tensor-parallel; the model is then its slice.
    ``quantization``: quantize the linear layers once loaded (``tandem.engine.quantization``);
    a quantized checkpoint (``tandem quantize``) always loads quantized, as it was written."""
    cls = model_class(config)
    stored = stored_quantization(model_dir)
    with torch.device("meta"):
        model = cls(config, dtype)
        if tp is not None and tp.size > 1:
            shard_model(model, config, tp, expert_split)
        if stored is not None:
            quantize_model(model, stored, empty=True)
        model = model.to(dtype)
    model = model.to_empty(device=device)
    _keep_float32(model, device)
    if config.tie_word_embeddings and not isinstance(model.lm_head, QuantizedLinear):
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        tensors = iter_checkpoint_tensors(model_dir)
        if stored is not None:
            filled = load_quantized(model, tensors)
        else:
            filled = model.load_weights(tensors)
    missing = sorted(set(dict(model.named_parameters())) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(f"checkpoint in {model_dir!s} is missing tensors: {shown}")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
    if stored is not None:  # its experts were stored float
        with torch.no_grad():
            quantize_experts(model, stored)
    if quantization is not None and stored is None:
        with torch.no_grad():
            quantize_model(model, quantization)
    return model.eval().requires_grad_(False)


def _keep_float32(model: nn.Module, device: torch.device) -> None:
    """Parameters a module lists in ``float32_params`` go back to float32 (empty, before
    loading) in a model of a lower dtype: DeepSeek's router and correction bias."""
    for module in model.modules():
        for name in getattr(module, "float32_params", ()):
            param = getattr(module, name, None)
            if param is not None and param.dtype != torch.float32:
                fresh = torch.empty(param.shape, dtype=torch.float32, device=device)
                setattr(module, name, nn.Parameter(fresh, requires_grad=False))
