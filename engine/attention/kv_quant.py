"""How keys and values are stored in the paged cache: as computed, or quantized to one byte.

A quantized cache is one ``uint8`` tensor per layer, ``[2, num_blocks, block_size,
num_kv_heads, head_dim + 4]``: for each token and KV head, ``head_dim`` one-byte codes
(``int8`` or ``float8_e4m3fn``) followed by the little-endian ``float32`` scale they are
multiplied by. The scale lives in the same row as its codes, so a block is still one
contiguous tile: block copies (prefix reuse, KV transfer) move codes and scales together,
and each tensor-parallel rank quantizes only its own heads.

- ``int8``: symmetric absmax, ``scale = max|x| / 127``, ``code = round(x / scale)``;
  the error of a value is at most ``scale / 2``.
- ``fp8``: ``scale = max|x| / 448`` (e4m3's largest finite value), ``code = e4m3(x /
  scale)``: 3 mantissa bits, a relative error of at most 2**-4 for normal codes.

Attention always reads the dequantized values, the current step's own tokens included
(``KVCodec.roundtrip``), so a token's attention does not depend on whether its context
came from this step, the prefix cache or another worker.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

SCALE_BYTES = 4
"""One float32 scale per token and KV head, stored after its codes."""
_TINY = torch.finfo(torch.float32).tiny


class KVCacheDtype(enum.Enum):
    AUTO = "auto"
    """The model's dtype: values stored as computed."""
    INT8 = "int8"
    FP8 = "fp8"
    """``torch.float8_e4m3fn`` codes."""

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDtype.AUTO


class KVCodec(Protocol):
    """Writes new keys/values into one layer's cache and turns gathered cache rows back
    into values. Chosen once per backend (``make_kv_codec``)."""

    def write(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Stores ``k, v [T, KVH, D]`` at cache slots ``slots [T]``."""
        ...

    def write_plane(self, plane: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores ``x [T, KVH, D]`` at ``slots`` of one plane ``[num_blocks, block_size,
        KVH, width]`` (a latent cache has one plane, not K and V)."""
        ...

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows ``[..., KVH, width]`` → values ``[..., KVH, D]`` in ``dtype``."""
        ...

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as attention would read it back from the cache."""
        ...


class FloatKV:
    """Values stored as computed: reads are the rows themselves."""

    def write(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        kv_heads, head_dim = k.shape[1], k.shape[2]
        kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    def write_plane(self, plane: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        plane.view(-1, x.shape[1], x.shape[2]).index_copy_(0, slots, x)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return x


class QuantizedKV:
    """One-byte codes with a float32 scale per token and head (see the module docstring)."""

    def __init__(self, kind: KVCacheDtype) -> None:
        if not kind.quantized:
            raise ValueError(f"{kind.value!r} is not a quantized KV cache dtype")
        self.kind = kind
        int8 = kind is KVCacheDtype.INT8
        self.code_dtype = torch.int8 if int8 else torch.float8_e4m3fn
        self.max_code = 127.0 if int8 else 448.0
        self._encode = _int8_codes if int8 else _fp8_codes

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` (any float dtype) → rows ``[..., D + 4]`` uint8."""
        x = x.float()
        # An all-zero row gets the smallest normal scale: its codes are 0 either way.
        scale = (x.abs().amax(dim=-1, keepdim=True) / self.max_code).clamp_min_(_TINY)
        codes = self._encode(x / scale)
        return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``[..., D + 4]`` uint8 → values ``[..., D]`` in ``dtype``."""
        head_dim = rows.shape[-1] - SCALE_BYTES
        codes = rows[..., :head_dim].contiguous().view(self.code_dtype)
        scale = rows[..., head_dim:].contiguous().view(torch.float32)
        return (codes.float() * scale).to(dtype)

    def write(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        # K and V in one pass: each torch op costs a few microseconds at decode sizes.
        kv_heads, width = kv_cache.shape[-2], kv_cache.shape[-1]
        rows = self.quantize(torch.stack((k, v)))
        kv_cache.view(2, -1, kv_heads, width).index_copy_(1, slots, rows)

    def write_plane(self, plane: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        rows = self.quantize(x)
        plane.view(-1, rows.shape[1], rows.shape[2]).index_copy_(0, slots, rows)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(rows, dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(x), x.dtype)


def _int8_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Values in [-127, 127] (owned by the caller: rounded in place) → int8 codes."""
    return scaled.round_().clamp_(-127, 127).to(torch.int8)


def _fp8_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Values in [-448, 448] (clamped in place against rounding at the edge) → e4m3."""
    return scaled.clamp_(-448, 448).to(torch.float8_e4m3fn)


def make_kv_codec(kind: KVCacheDtype) -> KVCodec:
    return QuantizedKV(kind) if kind.quantized else FloatKV()


def cache_row(kind: KVCacheDtype, head_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """``(width, storage dtype)`` of one token-head row of the cache: ``(head_dim,
    dtype)`` unquantized, ``(head_dim + 4, uint8)`` quantized."""
    if kind.quantized:
        return head_dim + SCALE_BYTES, torch.uint8
    return head_dim, dtype


KV_CACHE_DTYPE_ALIASES: dict[str, KVCacheDtype] = {"fp8_e4m3": KVCacheDtype.FP8}
"""Other names a vLLM user passes for the same storage; a layout, a handshake or a log
line always names the canonical value."""


def parse_kv_cache_dtype(name: str) -> KVCacheDtype:
    """The storage ``name`` (or its alias) stands for; ``ValueError`` naming the valid
    choices for an unknown name."""
    if name in KV_CACHE_DTYPE_ALIASES:
        return KV_CACHE_DTYPE_ALIASES[name]
    try:
        return KVCacheDtype(name)
    except ValueError:
        valid = ", ".join([*(k.value for k in KVCacheDtype), *KV_CACHE_DTYPE_ALIASES])
        hint = ""
        if name == "fp8_e5m2":
            hint = " (fp8 stores e4m3 codes with a scale per token and head; e5m2 is not built)"
        raise ValueError(f"kv_cache_dtype must be one of {valid}; got {name!r}{hint}") from None
