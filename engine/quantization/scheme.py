"""What weight quantization means here: the methods, their settings, and the maths.

- ``int8``: symmetric, one float32 scale per output channel (row):
  ``s = max|w_row| / 127``, ``q = round(w / s)`` in ``[-127, 127]``, ``w ~ s * q``.
- ``int4``: asymmetric, per group of ``group_size`` input channels of a row (the last
  group of a row may be shorter): the range ``[min(w_g, 0), max(w_g, 0)]`` (so 0 is
  exact) is cut in 15 steps, ``s = (max - min) / 15``, ``z = round(-min / s)`` in
  ``[0, 15]``, ``q = clamp(round(w / s) + z, 0, 15)``, ``w ~ s * (q - z)``.

Either way ``|w - dequantize(q)| <= s / 2`` (up to float rounding). A row or group of
zeros gets ``s = 1`` (any scale is exact there). int4 values are packed two to a byte in
blocks of 32 inputs: byte ``b`` of a block holds input ``b`` (low nibble) and input
``b + 16`` (high nibble); a row takes ``ceil(k / 32) * 16`` bytes, the last block
zero-padded. The layout is the kernels' and the quantized checkpoint's alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

INT4_BLOCK = 32
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64


class QuantMethod(enum.Enum):
    INT8 = "int8"
    INT4 = "int4"


@dataclass(frozen=True)
class QuantizationConfig:
    """How a model's linear layers are quantized. ``group_size`` matters for int4 only."""

    method: QuantMethod
    group_size: int = DEFAULT_GROUP_SIZE
    lm_head: bool = False
    """Quantize the output projection too (the embedding always stays float)."""

    def __post_init__(self) -> None:
        if self.method is QuantMethod.INT4 and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, "
                f"got {self.group_size}"
            )

    def to_json(self) -> dict[str, object]:
        """The ``quantization_config`` entry of a quantized checkpoint's config.json."""
        out: dict[str, object] = {"quant_method": "tandem", "method": self.method.value}
        if self.method is QuantMethod.INT4:
            out["group_size"] = self.group_size
        out["lm_head"] = self.lm_head
        return out

    @classmethod
    def from_json(cls, entry: dict[str, object]) -> QuantizationConfig:
        """``ValueError`` naming the field for an entry ``to_json`` could not have written."""
        if entry.get("quant_method") != "tandem":
            raise ValueError(
                f"unsupported quantization_config (quant_method {entry.get('quant_method')!r}); "
                "only checkpoints written by `tandem quantize` load quantized"
            )
        valid = [m.value for m in QuantMethod]
        method, group = entry.get("method"), entry.get("group_size", DEFAULT_GROUP_SIZE)
        lm_head = entry.get("lm_head", False)
        if method not in valid:
            raise ValueError(f"quantization_config.method must be one of {valid}, got {method!r}")
        if not isinstance(group, int) or isinstance(group, bool):
            raise ValueError(f"quantization_config.group_size must be an integer, got {group!r}")
        if not isinstance(lm_head, bool):
            raise ValueError(f"quantization_config.lm_head must be true or false, got {lm_head!r}")
        return cls(QuantMethod(method), group, lm_head)

    def matches(self, other: QuantizationConfig) -> bool:
        """The same weights on disk: method, LM head, and (int4) group size."""
        return (
            self.method is other.method
            and self.lm_head == other.lm_head
            and (self.method is QuantMethod.INT8 or self.group_size == other.group_size)
        )

    def describe(self) -> str:
        """``int8`` / ``int4 (group 64)``, with ``, LM head too`` when it is quantized."""
        group = f" (group {self.group_size})" if self.method is QuantMethod.INT4 else ""
        return f"{self.method.value}{group}{', LM head too' if self.lm_head else ''}"


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[n, k]`` weight: ``qweight`` int8 ``[n, k]`` (int8) or packed uint8
    ``[n, ceil(k/32)*16]`` (int4); ``scales`` float32 ``[n]`` (int8) or
    ``[n, ceil(k/group)]`` (int4); ``zeros`` uint8 like the int4 scales, ``None`` for int8."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    in_features: int


def empty_quantized(n: int, k: int, config: QuantizationConfig) -> QuantizedWeight:
    """Uninitialised tensors of the shapes an ``[n, k]`` weight quantizes to (on the
    current default device: the meta device while a model is built)."""
    if config.method is QuantMethod.INT8:
        return QuantizedWeight(
            torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32), None, k
        )
    groups = -(-k // config.group_size)
    return QuantizedWeight(
        torch.empty(n, -(-k // INT4_BLOCK) * INT4_BLOCK // 2, dtype=torch.uint8),
        torch.empty(n, groups, dtype=torch.float32),
        torch.empty(n, groups, dtype=torch.uint8),
        k,
    )


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-row scales of a float ``[n, k]`` weight (``absmax / 127``; 1 for zero rows)."""
    absmax = weight.abs().amax(dim=1).float()
    return scales_from_absmax(absmax)


def scales_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    return torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))


def quantize_int8(weight: torch.Tensor, scales: torch.Tensor | None = None) -> QuantizedWeight:
    """``scales``: given when the row maxima cover more columns than ``weight`` holds
    (a row-parallel slice uses the full row's scale); by default the rows' own."""
    w = weight.float()
    s = int8_scales(w) if scales is None else scales
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), s.contiguous(), None, w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    w = weight.float()
    n, k = w.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size)
    padded[:, :k] = w
    # Padding with zeros changes no group's range: 0 is always in it.
    g = padded.view(n, groups, group_size)
    lo = g.amin(dim=2).clamp(max=0)
    hi = g.amax(dim=2).clamp(min=0)
    span = hi - lo
    s = torch.where(span > 0, span / 15.0, torch.ones_like(span))
    z = torch.round(-lo / s).clamp_(0, 15)
    q = (torch.round(g / s[..., None]) + z[..., None]).clamp_(0, 15)
    q = q.view(n, groups * group_size)[:, :k].to(torch.uint8)
    return QuantizedWeight(pack_int4(q), s.contiguous(), z.to(torch.uint8).contiguous(), k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` values in ``[0, 15]`` -> ``[n, ceil(k/32)*16]`` bytes (module docstring)."""
    n, k = q.shape
    blocks = -(-k // INT4_BLOCK)
    full = torch.zeros(n, blocks * INT4_BLOCK, dtype=torch.uint8)
    full[:, :k] = q
    full = full.view(n, blocks, 2, INT4_BLOCK // 2)
    return (full[:, :, 0] | (full[:, :, 1] << 4)).reshape(n, blocks * INT4_BLOCK // 2)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of ``pack_int4``: ``[n, k]`` uint8 values."""
    n = packed.shape[0]
    b = packed.view(n, -1, INT4_BLOCK // 2)
    both = torch.stack((b & 15, b >> 4), dim=2)
    return both.reshape(n, -1)[:, :k]


def dequantize(weight: QuantizedWeight, method: QuantMethod, group_size: int) -> torch.Tensor:
    """The float32 ``[n, k]`` weight a quantized one stands for (plain torch: the
    reference the native kernels are tested against)."""
    if method is QuantMethod.INT8:
        return weight.qweight.float() * weight.scales[:, None]
    assert weight.zeros is not None
    k = weight.in_features
    q = unpack_int4(weight.qweight, k).float()
    index = torch.arange(k) // group_size
    return (q - weight.zeros[:, index].float()) * weight.scales[:, index]
