"""RMSNorm, optionally fused with the residual add that precedes it; Gemma's variant."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tandem.engine.layers.native_ops import FusedOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.native: FusedOps | None = None
        """Set by ``native_ops.use_native_ops`` (float32 CPU inference): one C pass per
        row instead of the torch ops below."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 whatever the model dtype, then scale in the model dtype:
        # the order HF Llama uses, so float32 results agree bit for bit.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the pre-norm pattern of every block.
        The caller gives up ``residual``: the sum may be written into it."""
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the stored weight is an offset from one (``x̂ * (1 + w)``), and the
    whole product is taken in float32 before the cast back (Llama casts ``x̂`` first)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
