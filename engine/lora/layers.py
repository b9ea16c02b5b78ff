"""A linear layer with every resident adapter's products beside it, applied per token.

``LoRALinear`` wraps a target layer as loading and packing left it (a plain, packed,
quantized or parallel product) and adds, for each token row, the delta of the adapter
that row runs under::

    y = base(x) + B_s (A_s x) * scaling_s        (s: the row's slot; none: y = base(x))

Each wrapped layer holds the adapters of all ``max_loras`` slots stacked: ``a [L, S*R,
in]`` and ``bt [L, S*R, out]`` (S slices of the fused output, R the largest rank; a
slice's rows sit at ``j*R`` and its B only in its own output columns; unused rows stay
zero; the scaling is folded into ``bt``). One forward's rows come sorted by slot
(``ModelRunner``), so every adapter's rows are a few contiguous runs of the batch.

A row-parallel layer (``o_proj``, ``down_proj`` under tensor parallelism) sees only its
input columns: ``A_s x`` is a partial sum that one all-reduce of the small ``[T, S*R]``
product completes before ``bt`` expands it, on every rank alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from tandem.engine.lora.kernels import LoRAKernels
from tandem.engine.lora.targets import Target
from tandem.engine.parallel.group import TensorParallelGroup


@dataclass
class LoRABatch:
    """Which slot each token row of the current forward runs under; set by the runner
    before each forward, read by every ``LoRALinear``."""

    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """``[T]`` int64, -1 for rows of the base model."""
    runs: tuple[tuple[int, int, int], ...] = ()
    """``(slot, start, end)`` of each run of rows under one adapter (base rows left out)."""
    mask: int = 0
    """Bit ``s`` set when slot ``s`` has rows in this forward (0: a base-only forward)."""

    @classmethod
    def of(cls, slots: torch.Tensor) -> LoRABatch:
        values = slots.cpu().numpy()
        starts = np.flatnonzero(np.diff(values)) + 1
        bounds = np.concatenate(([0], starts, [len(values)]))
        runs = tuple(
            (int(values[a]), int(a), int(b))
            for a, b in itertools.pairwise(bounds)
            if b > a and values[a] >= 0
        )
        mask = 0
        for slot, _, _ in runs:
            mask |= 1 << slot
        return cls(slots, runs, mask)


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        target: Target,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        batch: LoRABatch,
        kernels: LoRAKernels | None,
        group: TensorParallelGroup | None,
        device: torch.device | None = None,
    ) -> None:
        """``batch``: the runner's per-forward row slots, shared by every wrapped layer.
        ``kernels``: the native products (float32 CPU), else torch. ``group``: the ranks
        a row-parallel layer's partial products are summed over."""
        super().__init__()
        self.base, self.target, self.batch = base, target, batch
        self.max_rank, self.kernels = max_rank, kernels
        self.group = group if target.row_parallel else None
        slices = len(target.slices)
        in_local = target.in_span.size if target.in_span is not None else target.in_features
        width = slices * max_rank
        self.a = torch.zeros(max_loras, width, in_local, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, width, target.out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32)
        """Per slot, the rows of each slice its adapter uses here (0: none)."""
        self.offsets = torch.tensor(
            [s.offset for s in target.slices] + [target.out_features], dtype=torch.int64
        )
        self.present = 0
        """Bit ``s`` set when the adapter in slot ``s`` has weights for this layer."""

    def set_slot(self, slot: int, weights: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's weights for this layer in ``slot``: ``(slice, A [r, in_local],
        B [held rows, r])`` with the scaling folded into B; empty: it has none here."""
        self.clear_slot(slot)
        rank = 0
        for j, a, b in weights:
            r = a.shape[0]
            rows = slice(j * self.max_rank, j * self.max_rank + r)
            cols = self.target.slices[j]
            self.a[slot, rows].copy_(a)
            self.bt[slot, rows, cols.offset : cols.offset + cols.held.size].copy_(b.T)
            rank = max(rank, r)
        if rank:
            self.ranks[slot] = rank
            self.present |= 1 << slot

    def clear_slot(self, slot: int) -> None:
        if self.present >> slot & 1:
            self.a[slot].zero_()
            self.bt[slot].zero_()
            self.ranks[slot] = 0
            self.present &= ~(1 << slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.mask & self.present:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.kernels is not None:
            u = self.kernels.shrink(x2, batch.slots, self.a, self.ranks, self.max_rank)
            if self.group is not None:
                u = self.group.all_reduce(u)
            self.kernels.expand(
                u, y2, batch.slots, self.bt, self.ranks, self.offsets, self.max_rank
            )
            return y
        u = x2.new_zeros(x2.shape[0], self.a.shape[1])
        for slot, start, end in batch.runs:
            if self.present >> slot & 1:
                u[start:end] = x2[start:end] @ self.a[slot].T.to(x2.dtype)
        if self.group is not None:
            u = self.group.all_reduce(u)
        for slot, start, end in batch.runs:
            if self.present >> slot & 1:
                y2[start:end] += u[start:end] @ self.bt[slot].to(u.dtype)
        return y
