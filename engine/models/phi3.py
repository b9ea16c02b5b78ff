"""Phi-3: the Llama decoder whose checkpoint stores q/k/v as one ``qkv_proj`` and
gate/up as one ``gate_up_proj``, with a partial rotation (``partial_rotary_factor``:
only the leading dims of each head turn) and an optional sliding window on every layer.

The fused checkpoint tensors are read as the three (two) row ranges they stack, under
Llama's names, so loading, tensor-parallel slicing and quantization are Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from tandem.engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tandem.engine.loader import CheckpointTensor


class RowRange:
    """Rows ``[offset, offset + size)`` of a checkpoint tensor, read as a tensor of its
    own (``loader.CheckpointTensor``'s interface)."""

    def __init__(self, tensor: CheckpointTensor | RowRange, offset: int, size: int) -> None:
        self._tensor, self._offset, self._size = tensor, offset, size

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._size, *self._tensor.shape[1:])

    def full(self) -> torch.Tensor:
        return self._tensor.rows(self._offset, self._size)

    def rows(self, start: int, size: int) -> torch.Tensor:
        return self._tensor.rows(self._offset + start, size)

    def cols(self, start: int, size: int) -> torch.Tensor:
        return self._tensor.rows(self._offset, self._size)[:, start : start + size]


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return super().load_weights(self._split_fused(tensors))

    def _split_fused(
        self, tensors: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor | RowRange]]:
        c = self.config
        splits = {
            "self_attn.qkv_proj": (
                ("q_proj", c.q_size),
                ("k_proj", c.kv_size),
                ("v_proj", c.kv_size),
            ),
            "mlp.gate_up_proj": (
                ("gate_proj", c.intermediate_size),
                ("up_proj", c.intermediate_size),
            ),
        }
        for name, tensor in tensors:
            prefix, _, leaf = name.rpartition(".")
            block, _, fused = prefix.rpartition(".")
            parts = splits.get(f"{block.rpartition('.')[2]}.{fused}")
            if parts is None:
                yield name, tensor
                continue
            expected = sum(size for _, size in parts)
            if tensor.shape[0] != expected:
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {expected}"
                )
            offset = 0
            for part, size in parts:
                yield f"{block}.{part}.{leaf}", RowRange(tensor, offset, size)
                offset += size
