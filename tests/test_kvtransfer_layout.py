"""KV layout arithmetic and the handshake's compatibility check."""

from __future__ import annotations

import pytest
import torch

from tandem.kvtransfer.errors import IncompatibleKV
from tandem.kvtransfer.layout import KVLayout, check_compatible
from tandem.protos import PROTOCOL_VERSION

LAYOUT = KVLayout(
    "tiny-llama", num_layers=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float16
)


def test_sizes_and_shapes() -> None:
    assert LAYOUT.bytes_per_block == 4 * 2 * 16 * 2 * 8 * 2
    assert LAYOUT.cache_shape(10) == (2, 10, 16, 2, 8)
    assert LAYOUT.packed_shape(3) == (4, 2, 3, 16, 2, 8)


def test_compat_carries_every_field() -> None:
    compat = LAYOUT.to_compat()
    assert compat.protocol_version == PROTOCOL_VERSION
    assert (compat.model, compat.dtype, compat.layout) == (
        "tiny-llama",
        "float16",
        "layer,kv,block,slot,head,dim",
    )
    assert (compat.block_size, compat.num_layers, compat.num_kv_heads, compat.head_dim) == (
        16,
        4,
        2,
        8,
    )


def test_identical_layouts_are_compatible() -> None:
    check_compatible(LAYOUT, LAYOUT.to_compat())


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("protocol_version", PROTOCOL_VERSION + 1, "protocol version"),
        ("model", "other-model", "model"),
        ("dtype", "bfloat16", "dtype"),
        ("block_size", 32, "block size"),
        ("layout", "layer,block,kv,slot,head,dim", "KV layout"),
        ("num_kv_heads", 4, "KV heads"),
        ("head_dim", 16, "head dim"),
        ("num_layers", 5, "layers"),
    ],
)
def test_each_mismatch_is_refused_by_name(field: str, value: object, named: str) -> None:
    remote = LAYOUT.to_compat()
    setattr(remote, field, value)
    with pytest.raises(IncompatibleKV) as refused:
        check_compatible(LAYOUT, remote)
    assert [m.field for m in refused.value.mismatches] == [named]
    assert named in str(refused.value) and repr(value) in str(refused.value)


def test_all_mismatches_are_named_at_once() -> None:
    remote = LAYOUT.to_compat()
    remote.dtype, remote.block_size, remote.num_layers = "float32", 8, 2
    with pytest.raises(IncompatibleKV) as refused:
        check_compatible(LAYOUT, remote)
    assert [m.field for m in refused.value.mismatches] == ["dtype", "block size", "layers"]


def test_invalid_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVLayout("m", num_layers=1, block_size=0, num_kv_heads=1, head_dim=1, dtype=torch.float32)
