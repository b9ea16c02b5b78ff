"""The routing workloads: deterministic, shaped as specified, and the simulator's block
names behave exactly like the real chained hashes of the same prompts."""

from __future__ import annotations

import itertools

import pytest

from tandem.bench.prefix_workloads import BlockNamer, SegmentTokens, Shape, WorkloadSpec, generate
from tandem.bench.workloads import TokenPool
from tandem.common.hashing import hash_blocks

POOL = TokenPool.from_vocab(4096, range(10))


def small(shape: Shape, n: int = 400) -> WorkloadSpec:
    return WorkloadSpec(shape, rate=100.0, num_requests=n, num_prefixes=6, num_conversations=6)


@pytest.mark.parametrize("shape", list(Shape))
def test_block_names_are_a_bijection_with_real_block_hashes(shape: Shape) -> None:
    tokens, namer = SegmentTokens(POOL), BlockNamer(16)
    name_to_hash: dict[bytes, bytes] = {}
    hash_to_name: dict[bytes, bytes] = {}
    for plan in generate(small(shape)):
        names = namer.names(plan)
        real = hash_blocks(plan.token_ids(tokens), 16)
        assert len(names) == len(real) == plan.num_tokens // 16
        for name, h in zip(names, real, strict=True):
            assert name_to_hash.setdefault(name, h) == h
            assert hash_to_name.setdefault(h, name) == name


@pytest.mark.parametrize("shape", list(Shape))
def test_the_same_spec_gives_the_same_requests(shape: Shape) -> None:
    first, second = list(generate(small(shape, 50))), list(generate(small(shape, 50)))
    assert first == second
    assert all(b.at >= a.at for a, b in itertools.pairwise(first))


def test_chat_turns_extend_the_previous_prompt() -> None:
    plans = list(generate(small(Shape.CHAT, 200)))
    extended = 0
    for i, plan in enumerate(plans):
        for earlier in plans[:i]:
            n = len(earlier.segments)
            if len(plan.segments) > n and plan.segments[:n] == earlier.segments:
                extended += 1
                break
    assert extended > 150  # all but each conversation's first turn


def test_skewed_sends_half_of_the_traffic_to_one_prefix() -> None:
    plans = list(generate(small(Shape.SKEWED, 2000)))
    keys = [p.segments[0].key for p in plans]
    hot = max(set(keys), key=keys.count)
    assert 0.45 < keys.count(hot) / len(keys) < 0.55
    assert all(len(p.segments) == 2 for p in plans)


def test_unique_prompts_share_nothing() -> None:
    namer = BlockNamer(16)
    names = [n for plan in generate(small(Shape.UNIQUE, 200)) for n in namer.names(plan)]
    assert len(names) == len(set(names))
