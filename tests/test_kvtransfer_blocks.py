"""Packing named paged-KV blocks into one buffer and scattering them back."""

from __future__ import annotations

import pytest
import torch

from tandem.kvtransfer.blocks import pack_blocks, unpack_blocks
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.testing import random_kv_caches

LAYOUT = KVLayout("m", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_pack_holds_exactly_the_named_blocks_in_order() -> None:
    caches = random_kv_caches(LAYOUT, num_blocks=10, seed=1)
    packed = pack_blocks(caches, [7, 2, 5])
    assert packed.shape == LAYOUT.packed_shape(3) and packed.is_contiguous()
    for layer, cache in enumerate(caches):
        for i, block in enumerate([7, 2, 5]):
            assert torch.equal(packed[layer, :, i], cache[:, block])


def test_round_trip_writes_only_the_named_blocks() -> None:
    source = random_kv_caches(LAYOUT, num_blocks=10, seed=1)
    dest = random_kv_caches(LAYOUT, num_blocks=6, seed=2)
    before = [cache.clone() for cache in dest]
    unpack_blocks(dest, [4, 0, 3], pack_blocks(source, [9, 1, 8]))
    for layer in range(LAYOUT.num_layers):
        for src, dst in [(9, 4), (1, 0), (8, 3)]:
            assert torch.equal(dest[layer][:, dst], source[layer][:, src])
        for untouched in [1, 2, 5]:
            assert torch.equal(dest[layer][:, untouched], before[layer][:, untouched])


def test_out_buffer_is_reused() -> None:
    caches = random_kv_caches(LAYOUT, num_blocks=10, seed=1)
    out = torch.empty(LAYOUT.packed_shape(2))
    assert pack_blocks(caches, [3, 4], out=out) is out
    assert torch.equal(out, pack_blocks(caches, [3, 4]))


def test_mismatched_buffers_are_refused() -> None:
    caches = random_kv_caches(LAYOUT, num_blocks=10, seed=1)
    with pytest.raises(ValueError, match="shape"):
        pack_blocks(caches, [3, 4], out=torch.empty(LAYOUT.packed_shape(3)))
    with pytest.raises(ValueError, match="float64"):
        unpack_blocks(caches, [3], torch.zeros(LAYOUT.packed_shape(1), dtype=torch.float64))
    with pytest.raises(ValueError, match="no block ids"):
        pack_blocks(caches, [])
