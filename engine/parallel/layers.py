"""Layers that hold one rank's slice of a weight, and load only that slice.

Each reads its slice straight from the checkpoint (``loader.CheckpointTensor``: a
memory-mapped safetensors tensor of which only the rows or columns asked for are read),
so no rank ever holds a full weight.

- ``ColumnParallelLinear``: output rows split; no communication (the output stays split:
  q/k/v heads, gate/up columns). One fused parameter may stack several checkpoint
  tensors (``q_proj``, ``k_proj``, ``v_proj``), each with its own slice.
- ``RowParallelLinear``: input columns split; the partial products are summed over the
  ranks (one all-reduce: ``o_proj``, ``down_proj``). Packed
  (``layers.linear.pack_linear_layers``) it becomes ``PackedRowParallelLinear``, which
  keeps the all-reduce.
- ``VocabParallelEmbedding``: vocabulary rows split; a rank looks up the ids it holds,
  zeros the rest, and one all-reduce adds the ranks' rows (exactly one is non-zero).
- ``ParallelLMHead``: vocabulary rows split; rank 0 gathers the logits for sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.parallel.group import TensorParallelGroup


class CheckpointSlice(Protocol):
    """What a parallel layer needs of a checkpoint tensor (``loader.CheckpointTensor``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def rows(self, start: int, size: int) -> torch.Tensor: ...

    def cols(self, start: int, size: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Span:
    """Rows ``[start, start + size)`` of a full-size dimension."""

    start: int
    size: int


def even_span(full: int, rank: int, size: int) -> Span:
    per = full // size
    return Span(rank * per, per)


def _copy_checked(dest: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if dest.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(source.shape)}, "
            f"expected {tuple(dest.shape)}"
        )
    dest.copy_(source)


class ColumnParallelLinear(nn.Linear):
    """``spans[i]``: the rows this rank holds of stacked checkpoint tensor ``i``."""

    def __init__(self, in_features: int, spans: Sequence[Span], bias: bool) -> None:
        super().__init__(in_features, sum(s.size for s in spans), bias=bias)
        self.spans = tuple(spans)

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        index = shard or 0
        span = self.spans[index]
        offset = sum(s.size for s in self.spans[:index])
        dest = getattr(self, leaf).data.narrow(0, offset, span.size)
        _copy_checked(dest, tensor.rows(span.start, span.size), f"{leaf} shard {index}")


class RowParallelLinear(nn.Linear):
    """Holds input columns ``span``; the output is summed over the ranks. No bias (no
    supported architecture has one here; it would be added once, after the sum)."""

    def __init__(self, span: Span, out_features: int, group: TensorParallelGroup) -> None:
        super().__init__(span.size, out_features, bias=False)
        self.span = span
        self.group = group

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        _copy_checked(self.weight.data, tensor.cols(self.span.start, self.span.size), leaf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))

    def packed(self, pack: Callable[[nn.Linear], nn.Module]) -> PackedRowParallelLinear:
        """This layer with its product packed by ``pack`` (oneDNN or native), the
        all-reduce kept."""
        return PackedRowParallelLinear(pack(self), self.group)


class PackedRowParallelLinear(nn.Module):
    """A ``RowParallelLinear`` whose weight was packed once; inference only."""

    def __init__(self, product: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.product = product
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.product(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows_per_rank)`` of the vocabulary; the last rank's rows
    past the vocabulary stay zero (padding, so every rank holds the same shape)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // group.size)
        self.start = group.rank * self.rows_per_rank
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))

    @property
    def num_real_rows(self) -> int:
        return max(0, min(self.rows_per_rank, self.vocab_size - self.start))

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        real = self.num_real_rows
        self.weight.data[real:].zero_()
        _copy_checked(self.weight.data[:real], tensor.rows(self.start, real), leaf)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        held = (local >= 0) & (local < self.rows_per_rank)
        rows = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        return self.group.all_reduce(rows * held.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(nn.Module):
    """The output projection over this rank's vocabulary rows (the embedding's own
    weight, when tied: the same rows). ``forward`` returns the full logits on rank 0,
    ``None`` on the others."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.vocab_size, self.group = embedding.vocab_size, embedding.group
        self.start, self.num_real_rows = embedding.start, embedding.num_real_rows
        self.weight = embedding.weight if tied else nn.Parameter(torch.empty_like(embedding.weight))

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: int | None) -> None:
        real = self.num_real_rows
        self.weight.data[real:].zero_()
        _copy_checked(self.weight.data[:real], tensor.rows(self.start, real), leaf)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.group.gather_last_dim(F.linear(hidden, self.weight))
        return None if logits is None else logits[..., : self.vocab_size]
