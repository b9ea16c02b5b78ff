"""Chained block hashes: stable on the wire, chained, only full blocks."""

from __future__ import annotations

import pytest

from tandem.common.hashing import hash_block, hash_blocks, root_hash


def test_known_answer_pins_the_wire_format() -> None:
    # Routers and workers of different versions must agree: changing the function is a
    # protocol change, and this test makes it a deliberate one.
    assert hash_blocks(list(range(32)), 16)[1].hex() == KNOWN_SECOND_BLOCK


def test_hash_depends_on_every_earlier_block() -> None:
    a = hash_blocks([1] * 16 + [2] * 16, 16)
    b = hash_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first block


def test_only_full_blocks_are_hashed_and_resume_matches() -> None:
    tokens = list(range(50))
    full = hash_blocks(tokens, 16)
    assert len(full) == 3
    assert hash_blocks(tokens, 16, parent=full[0], start_block=1) == full[1:]
    assert full[0] == hash_block(root_hash(), tokens[:16])


def test_namespaces_do_not_share_blocks() -> None:
    assert hash_blocks([1] * 16, 16, parent=root_hash("a")) != hash_blocks([1] * 16, 16)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0)


KNOWN_SECOND_BLOCK = "1148a82e68def7f8218a535f6893214a"
