"""What both ends of a KV transfer must agree on, and the handshake check of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tandem.engine.attention.kv_quant import KVCacheDtype, cache_row
from tandem.kvtransfer.errors import FieldMismatch, IncompatibleKV
from tandem.protos import PROTOCOL_VERSION, kv_transfer_pb2


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: the spelling used on the wire."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Shape and type of one engine's paged KV cache.

    The engine's cache is one tensor per layer, ``[2 (K, V), num_blocks, block_size,
    num_kv_heads, row_width]`` of ``storage_dtype``; block ids index dim 1. Packed blocks
    travel as one ``[num_layers, 2, n, block_size, num_kv_heads, row_width]`` tensor
    (``WIRE_LAYOUT``). A quantized cache (``kv_cache_dtype`` int8 / fp8) is uint8 rows of
    ``head_dim`` codes + a float32 scale: the wire carries codes and scales as stored.
    A latent cache (multi-head latent attention, ``planes`` 1) has one plane instead of
    K and V, ``[num_layers, 1, n, block_size, 1, latent + rope]`` on the wire
    (``LATENT_WIRE_LAYOUT``): the compressed latent moves, not expanded keys and values.
    """

    WIRE_LAYOUT: ClassVar[str] = "layer,kv,block,slot,head,dim"
    LATENT_WIRE_LAYOUT: ClassVar[str] = "layer,latent,block,slot,head,dim"

    model: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tp_size: int = 1
    """Ranks of the replica (``num_kv_heads`` is one rank's share)."""
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    planes: int = 2
    """2 (K, V), or 1 for a latent cache."""

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise ValueError(f"KVLayout.planes must be 1 (latent) or 2 (K, V), got {self.planes}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def row_width(self) -> int:
        """Elements per token and KV head in the cache (``head_dim``, + 4 quantized)."""
        return cache_row(self.kv_cache_dtype, self.head_dim, self.dtype)[0]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensors' dtype: ``dtype``, or ``uint8`` quantized."""
        return cache_row(self.kv_cache_dtype, self.head_dim, self.dtype)[1]

    @property
    def bytes_per_block(self) -> int:
        """K and V (or the latent) of one block across all layers."""
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        per_layer = self.planes * self.block_size * self.num_kv_heads * self.row_width * itemsize
        return self.num_layers * per_layer

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding ``num_blocks`` blocks."""
        return (self.planes, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    def packed_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``num_blocks`` packed blocks (see ``blocks.pack_blocks``)."""
        return (self.num_layers, *self.cache_shape(num_blocks))

    def to_compat(self) -> kv_transfer_pb2.KVCompat:
        return kv_transfer_pb2.KVCompat(
            protocol_version=PROTOCOL_VERSION,
            model=self.model,
            dtype=dtype_name(self.dtype),
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            layout=self.WIRE_LAYOUT if self.planes == 2 else self.LATENT_WIRE_LAYOUT,
            tp_size=self.tp_size,
            kv_cache_dtype=self.kv_cache_dtype.value,
        )


_CHECKED_FIELDS = (
    ("protocol version", "protocol_version"),
    ("model", "model"),
    ("dtype", "dtype"),
    ("kv cache dtype", "kv_cache_dtype"),
    ("block size", "block_size"),
    ("KV layout", "layout"),
    ("tensor-parallel size", "tp_size"),
    ("KV heads", "num_kv_heads"),
    ("head dim", "head_dim"),
    ("layers", "num_layers"),
)


def check_compatible(local: KVLayout, remote: kv_transfer_pb2.KVCompat) -> None:
    """Raises ``IncompatibleKV`` naming every field on which ``remote`` differs from
    ``local`` (protocol version included); returns ``None`` when they match."""
    mine = local.to_compat()
    mismatches = [
        FieldMismatch(label, getattr(mine, attr), getattr(remote, attr))
        for label, attr in _CHECKED_FIELDS
        if getattr(mine, attr) != getattr(remote, attr)
    ]
    if mismatches:
        raise IncompatibleKV(mismatches)
