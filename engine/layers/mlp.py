"""The gated feed-forward block (SwiGLU, or GeGLU for Gemma), gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.model_config import Activation


def activate(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation is Activation.SILU:
        return F.silu(x)
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: Activation = Activation.SILU
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(activate(gate, self.activation) * up)
