"""Rotary position embeddings with the RoPE scalings found in Llama-family checkpoints.

cos/sin tables for every position up to the model's context are built once; a forward
pass only indexes them. ``rotate_half`` layout (the first half of the rotated dimensions
pairs with the second half), as HuggingFace checkpoints expect. With a partial rotary
factor (Phi-3, Phi-4-mini) only the leading ``rotary_dim`` dims of each head turn; the
rest pass through.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.common.model_config import RopeConfig, RopeScaling

if TYPE_CHECKING:
    from tandem.engine.layers.native_ops import FusedOps


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair rotation speeds, float32, shape ``[head_dim // 2]``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling is RopeScaling.LINEAR:
        return inv_freq / rope.factor
    if rope.scaling is RopeScaling.LLAMA3:
        return _llama3_scaled(inv_freq, rope)
    if rope.scaling is RopeScaling.YARN:
        return _yarn_scaled(inv_freq, head_dim, rope)
    return inv_freq


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: pairs that turn more than ``beta_fast`` times over the original context keep
    their speed (extrapolation), pairs that turn fewer than ``beta_slow`` times are
    slowed by ``factor`` (interpolation), and a linear ramp blends the band between."""
    old_len = rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        """The (fractional) dim index whose pair turns ``rotations`` times in ``old_len``."""
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dim band: avoid dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the speed), 0: interpolate
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths longer than ``old_len / low_freq_factor`` are slowed by
    ``factor``, shorter than ``old_len / high_freq_factor`` kept, and the band in between
    interpolated linearly in ``old_len / wavelength``."""
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_len / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * slowed / rope.factor + smooth * slowed
    in_band = ~(wavelen < old_len / rope.high_freq_factor) & ~(
        wavelen > old_len / rope.low_freq_factor
    )
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (computed in float32, stored in the model dtype) indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        dtype: torch.dtype,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        """``rotary_dim``: the leading dims of each head that turn (``None``: all).
        ``interleaved``: the checkpoint pairs dims (0, 1), (2, 3), ... (DeepSeek) rather
        than (0, d/2), (1, d/2 + 1), ...; the inputs are reordered to halves first, so
        rotated q and k come out in the halves layout (their dot products unchanged)."""
        super().__init__()
        self.interleaved = interleaved
        self.head_dim, self.max_positions, self.rope, self.dtype = (
            rotary_dim or head_dim,
            max_positions,
            rope,
            dtype,
        )
        self.partial = self.head_dim != head_dim
        self.register_buffer(
            "cos", torch.empty(max_positions, self.head_dim, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "sin", torch.empty(max_positions, self.head_dim, dtype=dtype), persistent=False
        )
        self.native: FusedOps | None = None
        """Set by ``native_ops.use_native_ops`` (float32 CPU inference): q and k rotated
        in one C call, without the torch path's temporaries."""

    def materialize(self, device: torch.device) -> None:
        """Fill the tables on ``device`` (models are built on the meta device, then loaded)."""
        inv_freq = inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        magnitude = self.rope.yarn_attention_factor
        self.cos = (angles.cos() * magnitude).to(self.dtype)
        self.sin = (angles.sin() * magnitude).to(self.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` by their token ``positions [T]``
        into new tensors."""
        if self.interleaved:
            q, k = _halves(q), _halves(k)
        if self.partial:
            return self._partial(positions, q, k)
        if self.native is not None:
            return self.native.rotary(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _partial(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        d = self.head_dim

        def turn(x: torch.Tensor) -> torch.Tensor:
            head, rest = x[..., :d], x[..., d:]
            return torch.cat([head * cos + _rotate_half(head) * sin, rest], dim=-1)

        return turn(q), turn(k)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Dims (0, 1), (2, 3), ... regrouped as evens then odds."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
