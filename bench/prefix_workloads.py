"""Workloads for prefix-aware routing, shared by the real cluster and the fleet simulator.

Four shapes (the issue's (a)-(d)):

* ``chat``   — multi-turn chat: each conversation's next turn is its previous prompt,
  the reply to it and a new user message;
* ``shared`` — few-shot / system-prompt sharing: one of ``K`` long prefixes, then a
  short unique suffix;
* ``unique`` — nothing shared;
* ``skewed`` — like ``shared``, but one prefix carries half the traffic.

A prompt is a sequence of *segments*. A segment's tokens are fixed by its key (a seeded
draw), so two prompts share exactly the segments they have in common, and
``PromptPlan.token_ids`` gives the real cluster its prompts. The simulator never draws
tokens: ``BlockNamer`` names each full block by (the chain of segment keys up to it,
its end offset), which has the property chained block hashes have — two prompts share
block ``i`` exactly when they share their first ``(i + 1) * block_size`` tokens — at a
fraction of BLAKE2b's cost.

Arrivals are Poisson at ``rate`` requests/s. The same spec always gives the same
requests. Stdlib only.
"""

from __future__ import annotations

import enum
import random
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.bench.workloads import IntRange, TokenPool


class Shape(enum.Enum):
    CHAT = "chat"
    SHARED = "shared"
    UNIQUE = "unique"
    SKEWED = "skewed"


@dataclass(frozen=True)
class Segment:
    key: int
    """Names the content: equal keys, equal tokens."""
    length: int


@dataclass(frozen=True)
class PromptPlan:
    at: float
    """Send time, seconds from the start of the run."""
    segments: tuple[Segment, ...]
    max_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def token_ids(self, tokens: SegmentTokens) -> list[int]:
        out: list[int] = []
        for segment in self.segments:
            out.extend(tokens.of(segment))
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload. Lengths are in tokens; ``rate`` in requests/s."""

    shape: Shape
    rate: float
    num_requests: int
    output_len: IntRange = IntRange(16, 64)
    seed: int = 0
    # shared / skewed
    num_prefixes: int = 64
    prefix_len: IntRange = IntRange(1000, 1800)
    suffix_len: IntRange = IntRange(16, 128)
    hot_share: float = 0.5
    """skewed: the share of requests that use prefix 0."""
    # unique
    prompt_len: IntRange = IntRange(256, 1900)
    # chat
    num_conversations: int = 64
    """Conversations in progress at any time (a finished one is replaced)."""
    opening_len: IntRange = IntRange(200, 800)
    user_len: IntRange = IntRange(20, 120)
    reply_len: IntRange = IntRange(30, 150)
    max_prompt_len: int = 1900
    """chat: a conversation whose next prompt would be longer ends instead."""

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.num_requests < 1:
            raise ValueError("rate must be > 0 and num_requests >= 1")
        if not 0 <= self.hot_share <= 1:
            raise ValueError(f"hot_share must be in [0, 1], got {self.hot_share}")


def generate(spec: WorkloadSpec) -> Iterator[PromptPlan]:
    """The workload's requests in send order (lazily: a simulator runs millions)."""
    rng = random.Random(f"{spec.shape.value}-{spec.seed}")
    arrivals = random.Random(f"arrivals-{spec.seed}")
    keys = _Keys(spec.seed)
    prompts = {
        Shape.CHAT: _chat,
        Shape.SHARED: _shared,
        Shape.UNIQUE: _unique,
        Shape.SKEWED: _shared,
    }[spec.shape](spec, rng, keys)
    now = 0.0
    for _ in range(spec.num_requests):
        yield PromptPlan(now, next(prompts), spec.output_len.draw(rng))
        now += arrivals.expovariate(spec.rate)


class _Keys:
    """Fresh segment keys; the seed keeps different runs' contents apart."""

    def __init__(self, seed: int) -> None:
        self._next = (seed & 0xFFFF) << 40

    def new(self) -> int:
        self._next += 1
        return self._next


def _shared(spec: WorkloadSpec, rng: random.Random, keys: _Keys) -> Iterator[tuple[Segment, ...]]:
    prefixes = [Segment(keys.new(), spec.prefix_len.draw(rng)) for _ in range(spec.num_prefixes)]
    hot = spec.shape is Shape.SKEWED
    while True:
        if hot and rng.random() < spec.hot_share:
            prefix = prefixes[0]
        else:
            prefix = prefixes[rng.randrange(1 if hot else 0, len(prefixes))]
        yield (prefix, Segment(keys.new(), spec.suffix_len.draw(rng)))


def _unique(spec: WorkloadSpec, rng: random.Random, keys: _Keys) -> Iterator[tuple[Segment, ...]]:
    while True:
        yield (Segment(keys.new(), spec.prompt_len.draw(rng)),)


def _chat(spec: WorkloadSpec, rng: random.Random, keys: _Keys) -> Iterator[tuple[Segment, ...]]:
    def opening() -> tuple[Segment, ...]:
        return (Segment(keys.new(), spec.opening_len.draw(rng)),)

    histories = [opening() for _ in range(spec.num_conversations)]
    while True:
        i = rng.randrange(len(histories))
        prompt = (*histories[i], Segment(keys.new(), spec.user_len.draw(rng)))
        if sum(s.length for s in prompt) > spec.max_prompt_len:
            histories[i] = opening()  # the conversation ended; another one starts
            prompt = (*histories[i], Segment(keys.new(), spec.user_len.draw(rng)))
        histories[i] = (*prompt, Segment(keys.new(), spec.reply_len.draw(rng)))
        yield prompt


class SegmentTokens:
    """The tokens of a segment: a draw seeded by its key (cached, prefixes recur)."""

    def __init__(self, pool: TokenPool, cache_size: int = 4096) -> None:
        self._pool = pool
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

    def of(self, segment: Segment) -> tuple[int, ...]:
        tokens = self._cache.get(segment.key)
        if tokens is None or len(tokens) != segment.length:
            tokens = self._pool.sample(random.Random(segment.key), segment.length)
            self._cache[segment.key] = tokens
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(segment.key)
        return tokens


class BlockNamer:
    """Names a plan's full blocks with chained-hash semantics, without hashing tokens.

    A block is named by (the id of the chain of segments up to the one holding its last
    token, the block's end offset in that segment): prompts that agree on every segment
    up to there agree on every token of the block and before it, and vice versa.
    """

    def __init__(self, block_size: int, memo_size: int = 65536) -> None:
        self.block_size = block_size
        self._memo: OrderedDict[tuple[int, int, int], tuple[bytes, ...]] = OrderedDict()
        self._memo_size = memo_size

    def names(self, plan: PromptPlan) -> tuple[bytes, ...]:
        out: list[bytes] = []
        chain = 0
        start = 0  # prompt offset of the current segment
        for segment in plan.segments:
            chain = hash((chain, segment.key)) & _U64  # ints hash the same in every process
            out.extend(self._segment_names(chain, start, segment.length))
            start += segment.length
        return tuple(out)

    def _segment_names(self, chain: int, start: int, length: int) -> tuple[bytes, ...]:
        """Names of the blocks ending inside a segment (memoized: prefixes recur)."""
        key = (chain, start, length)
        names = self._memo.get(key)
        if names is not None:
            self._memo.move_to_end(key)
            return names
        bs = self.block_size
        first_end = (start // bs + 1) * bs
        names = tuple(_PACK(chain, end - start) for end in range(first_end, start + length + 1, bs))
        self._memo[key] = names
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return names


_PACK = struct.Struct("<QQ").pack
_U64 = (1 << 64) - 1
