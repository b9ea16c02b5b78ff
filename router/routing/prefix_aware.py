"""Prefix-aware routing: send a request where its prompt's prefix is already cached,
unless that worker is overloaded.

The cost of sending a request of ``P`` prompt tokens to worker ``w``, in tokens:

    cost(w)     = w_uncached * uncached(w) + load(w)
    load(w)     = w_prefill * queued_prefill_tokens(w) + w_decode * running_seqs(w)
    uncached(w) = max(1, P - block_size * matched_blocks(w))

``uncached`` is what ``w`` lacks of the prompt: tokens a prefill worker computes, or a
decode worker pulls. With the prefill pool's defaults (``w_uncached = w_prefill = 1``,
``w_decode = 0``) the cost is *uncached prompt tokens + queued prefill tokens*: the
prefill work ahead of the request's first token. The decode pool's defaults weigh a
pulled token at a tenth of a computed one and add ``w_decode`` tokens per running
sequence (the batch the request joins).

* **Load guard.** A worker whose ``load`` exceeds ``imbalance_limit * mean load +
  imbalance_slack`` (mean over the pool) gets no credit for what it holds: for this
  request it is a worker like any other, so a hot prefix cannot pile work onto its
  holders; it spills to the least loaded worker, which then holds it too.
* **Busy guard** (``busy_slack``; on for the prefill pool). The same applies
  to a worker's reported recent busy share, which sees what momentary queues miss on a
  lightly loaded pool: the holders of a hot prefix idle at every decision yet busy
  several times as often as the rest. It applies only to a prefix that at least
  ``busy_min_holders`` workers of the pool hold: one already spread for load is hot,
  while one held by a single worker (a chat conversation, a rare system prompt) would
  only be recomputed elsewhere, paying a full miss and a second copy for nothing
  lasting. A hot prefix first spreads through the queue guard (its one holder's queue
  grows), so a single holder is never a pile-up the queue guard does not see. It
  applies only to a pool at rest: while the pool's mean load is under the queue guard's
  slack and its mean busy share under ``busy_max_mean``. A pool with queues has
  imbalance for the queue guard to see, and there a busy guard feeds on itself: each
  spill is a miss costing several hits' work, which makes the pool busier and the next
  spill likelier. In the simulator, 8 workers 65-75% busy went from 94% hits and 5 ms
  TTFT p50 to 86% and 630 ms without the busy bound; 8 starting cold, whose first busy
  reports were still out while queues grew, to 88% and 530 ms without the load bound.
  The busy shares the guard compares are the reports brought up to now with what the
  router sent since (``tandem.router.routing.inflight``).
* **KV room.** A worker without free KV blocks for the request's new blocks is chosen
  only when no worker has room.
* **Choice.** Temperature 0: the least cost; ties go to more matched blocks, then to
  less load; what is still tied goes to an idle worker: ``idle_choices`` are drawn from
  *all* idle ones with numbers taken from the request id, and the least busy lately
  (reported ``busy_fraction``) of those among the tied wins; if none is tied, one of
  the tied is drawn the same way. So equal work spreads evenly (a big fleet is mostly
  idle workers tied at zero load) instead of piling onto the smallest worker id, leans
  to the workers that did less lately (the power of d choices), and every replica
  chooses the same. Four independent draws by default: on the nearly idle 500-worker
  pool of the skewed workload, two evenly spaced ones gave a queue imbalance of
  1.25-1.33 over five runs, four independent ones 1.18-1.25 over three seeds (see the
  docs/benchmarks/routing.md).
  Temperature ``T > 0``: a draw among the ``softmax_candidates`` cheapest with
  probability proportional to ``exp(-(cost - min cost) / (T * w_uncached * P))``. The
  uniform number comes from BLAKE2b of the request id, so every router replica draws
  the same and replicas agree.

The decision is a pure function of (request with the index's answer, pool view).
Cost: O(matched workers) when up to ``DIRECT_HOLDERS`` workers hold the prefix; when
more do (a hot prefix on a large fleet) a sample of ``HOLDER_SAMPLE`` of them is
scored with the least loaded workers, so the decision does not grow with the fleet.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.common.registry import WorkerRecord, WorkerRole
from tandem.router.kv_index.index import PrefixMatch
from tandem.router.routing.pool_view import ListPool, PoolView

if TYPE_CHECKING:
    from tandem.router.routing.policy import RoutingRequest

DIRECT_HOLDERS = 64
"""Up to this many matched workers are all scored; beyond, a sample of them is."""
HOLDER_SAMPLE = 32
_ROOM_SPARE = 2  # extra least-loaded workers looked at in case the first lack KV room


@dataclass(frozen=True)
class PrefixCost:
    """The weights, guard and temperature of the cost above (tokens unless stated)."""

    uncached_weight: float = 1.0
    """w_uncached: per prompt token the worker lacks."""
    prefill_weight: float = 1.0
    """w_prefill: per prefill token already queued on the worker."""
    decode_weight: float = 0.0
    """w_decode: per sequence running on the worker."""
    imbalance_limit: float = 1.25
    """Guard: load above this multiple of the mean (plus the slack) voids affinity."""
    imbalance_slack: float = 256.0
    """Guard: load a worker may carry above the limit before the guard applies, so an
    almost idle pool does not scatter prefixes (same unit as ``load``)."""
    busy_limit: float = 1.1
    """Busy guard: the multiple of the pool's mean busy share above which (plus the
    slack) a holder of a prefix several workers hold gets no credit for it."""
    busy_slack: float | None = 0.0
    """Busy guard (off when ``None``, the decode pool's default): a worker whose reported
    ``busy_fraction`` exceeds ``busy_limit`` x the pool's mean + this also gets no
    credit for what it holds, for prefixes at least ``busy_min_holders`` of the pool's
    workers hold."""
    busy_min_holders: int = 2
    """The busy guard applies to prefixes at least this many workers of the pool hold."""
    busy_max_mean: float = 0.5
    """The busy guard applies while the pool's mean busy share is below this (and its
    mean load below ``imbalance_slack``): above it queues form and the queue guard sees
    imbalance, and a guard that spills misses onto a busy pool feeds on itself (each
    spill makes the pool busier)."""
    idle_choices: int = 4
    """Idle workers drawn per decision for the tie-break (the least busy is preferred)."""
    temperature: float = 0.0
    softmax_candidates: int = 8

    def __post_init__(self) -> None:
        if self.busy_slack is not None and self.busy_slack < 0:
            raise ValueError(f"busy_slack must be >= 0, got {self.busy_slack}")
        for name in ("uncached_weight", "prefill_weight", "decode_weight", "imbalance_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("imbalance_limit", "busy_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.busy_max_mean <= 1:
            raise ValueError(f"busy_max_mean must be in (0, 1], got {self.busy_max_mean}")
        if self.idle_choices < 1:
            raise ValueError(f"idle_choices must be >= 1, got {self.idle_choices}")
        if self.busy_min_holders < 1:
            raise ValueError(f"busy_min_holders must be >= 1, got {self.busy_min_holders}")
        if self.softmax_candidates < 1:
            raise ValueError(f"softmax_candidates must be >= 1, got {self.softmax_candidates}")

    @classmethod
    def default_for(cls, role: WorkerRole) -> PrefixCost:
        if role is WorkerRole.DECODE:
            return cls(
                uncached_weight=0.1, decode_weight=16.0, imbalance_slack=64.0, busy_slack=None
            )
        return cls()

    def load(self, record: WorkerRecord) -> float:
        load = record.load
        return (
            self.prefill_weight * load.num_queued_prefill_tokens
            + self.decode_weight * load.num_running_seqs
        )


@dataclass(frozen=True)
class PrefixDecision:
    """A choice and why: the blocks credited to it, its cost, and how many holders of
    the prefix the load guard denied affinity."""

    worker: WorkerRecord
    matched_blocks: int
    cost: float
    num_guarded: int


@dataclass(frozen=True)
class _Scored:
    record: WorkerRecord
    blocks: int
    cost: float
    room: bool
    key: tuple


class PrefixAwarePolicy:
    """``RoutingPolicy`` choosing by the cost in the module docstring; stateless."""

    name = "prefix_aware"
    uses_prefix_match = True

    def __init__(self, cost: PrefixCost | None = None) -> None:
        self.cost = cost or PrefixCost()

    def load_key(self, record: WorkerRecord) -> tuple:
        load = record.load
        free_share = load.free_kv_blocks / record.info.capacity.num_kv_blocks
        return (self.cost.load(record), -free_share, record.info.worker_id)

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        return self.choose(request, ListPool(candidates, self.load_key))

    def choose(self, request: RoutingRequest, pool: PoolView) -> WorkerRecord | None:
        decision = self.decide(request, pool)
        return None if decision is None else decision.worker

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        """Nothing to remember: the index and the load reports reflect the request."""

    def decide(self, request: RoutingRequest, pool: PoolView) -> PrefixDecision | None:
        """The choice with its reasons; ``None`` only for an empty pool. Pure."""
        if not len(pool):
            return None
        cost = self.cost
        mean_load = pool.mean_load()
        limit = cost.imbalance_limit * mean_load + cost.imbalance_slack
        busy_limit = math.inf
        if cost.busy_slack is not None and mean_load < cost.imbalance_slack:
            mean_busy = pool.mean_busy()
            if mean_busy < cost.busy_max_mean:
                busy_limit = cost.busy_limit * mean_busy + cost.busy_slack
        scorer = _Scorer(self, request.num_prompt_tokens, limit, busy_limit)
        matched = request.matched_blocks
        if len(matched) <= DIRECT_HOLDERS:
            self._score_holders_then_least_loaded(scorer, matched, pool)
        else:
            u = unit_draw(request.request_id, b"tandem-sample")
            self._score_a_sample_of_holders(scorer, matched, pool, u)
        # Independent draws: evenly spaced ones would let only 1 in idle_choices of a
        # fixed idle set ever win (each the least busy of its own stride).
        for i in range(cost.idle_choices):
            idle = pool.idle_at(unit_draw(request.request_id, b"tandem-idle%d" % i))
            if idle is None:
                break
            scorer.add(idle, matched.get(idle.info.worker_id, 0))
            scorer.idle_drawn.append(idle.info.worker_id)
        best = self._pick(request.request_id, request.num_prompt_tokens, scorer)
        return PrefixDecision(best.record, best.blocks, best.cost, scorer.num_guarded)

    # --- candidates --------------------------------------------------------------------

    def _score_holders_then_least_loaded(
        self, scorer: _Scorer, matched: Mapping[str, int], pool: PoolView
    ) -> None:
        self._score_holders(scorer, matched.items(), pool)
        wanted = 1 if self.cost.temperature == 0 else self.cost.softmax_candidates
        for record in pool.cheapest(wanted + _ROOM_SPARE, skip=scorer.scored):
            scorer.add(record, 0)

    def _score_a_sample_of_holders(
        self, scorer: _Scorer, matched: Mapping[str, int], pool: PoolView, u: float
    ) -> None:
        """Many holders (a hot prefix on a big fleet): score ``HOLDER_SAMPLE`` of them,
        deepest matches first, evenly spaced from an offset drawn from the request id,
        plus the least loaded workers. The least loaded of a random sample is close to
        the least loaded of all (the power of d choices), at a bounded cost. The busy
        guard's holder count is the sample's."""
        self._score_holders(scorer, _sample(matched, HOLDER_SAMPLE, u), pool)
        wanted = 1 if self.cost.temperature == 0 else self.cost.softmax_candidates
        for record in pool.cheapest(wanted + _ROOM_SPARE):
            scorer.add(record, matched.get(record.info.worker_id, 0))

    def _score_holders(
        self, scorer: _Scorer, matched: Iterable[tuple[str, int]], pool: PoolView
    ) -> None:
        """Score the holders in ``pool``; fewer than ``busy_min_holders`` of them turn
        the busy guard off for this request."""
        holders = [(pool.get(worker_id), blocks) for worker_id, blocks in matched]
        holders = [(record, blocks) for record, blocks in holders if record is not None]
        if len(holders) < self.cost.busy_min_holders:
            scorer.busy_limit = math.inf
        for record, blocks in holders:
            scorer.add(record, blocks)

    # --- the choice --------------------------------------------------------------------

    def _pick(self, request_id: str, num_prompt_tokens: int, scorer: _Scorer) -> _Scored:
        scored = scorer.scored
        fitting = [s for s in scored.values() if s.room] or list(scored.values())
        ranked = sorted(fitting, key=_rank)
        if self.cost.temperature == 0 or len(ranked) == 1:
            return self._break_tie(request_id, ranked, scorer.idle_drawn)
        ranked = ranked[: self.cost.softmax_candidates]
        scale = self.cost.temperature * max(1.0, self.cost.uncached_weight * num_prompt_tokens)
        weights = [math.exp(-(s.cost - ranked[0].cost) / scale) for s in ranked]
        target = unit_draw(request_id) * sum(weights)
        for s, weight in zip(ranked, weights, strict=True):
            target -= weight
            if target < 0:
                return s
        return ranked[-1]

    @staticmethod
    def _break_tie(request_id: str, ranked: list[_Scored], drawn: list[str]) -> _Scored:
        """Among the candidates tied with the best on (cost, matched, load): of the idle
        workers drawn for this request that are tied, the least busy lately; else one
        of the tied drawn by the request id. Not the least busy of *all* tied: busy
        shares are a heartbeat (a second) stale, and every tie going to the single least
        busy worker would flood it until its next report."""
        best = ranked[0]
        tied = [s for s in ranked if _tie(s) == _tie(best)]
        if len(tied) == 1:
            return best
        by_id = {s.record.info.worker_id: s for s in tied}
        idle = [by_id[w] for w in drawn if w in by_id]
        if idle:
            return min(idle, key=lambda s: s.record.load.busy_fraction)
        return tied[int(unit_draw(request_id, b"tandem-tie") * len(tied))]


class _Scorer:
    """Scores workers for one decision and keeps the results by worker id."""

    def __init__(
        self, policy: PrefixAwarePolicy, num_prompt_tokens: int, limit: float, busy_limit: float
    ) -> None:
        self.policy = policy
        self.num_prompt_tokens = num_prompt_tokens
        self.limit = limit
        self.busy_limit = busy_limit
        self.scored: dict[str, _Scored] = {}
        self.num_guarded = 0
        self.idle_drawn: list[str] = []  # idle workers drawn for the tie-break

    def add(self, record: WorkerRecord, blocks: int) -> None:
        worker_id = record.info.worker_id
        if worker_id in self.scored:
            return
        cost = self.policy.cost
        key = self.policy.load_key(record)
        load = key[0]
        if blocks and (load > self.limit or record.load.busy_fraction > self.busy_limit):
            self.num_guarded += 1
            blocks = 0
        block_size = record.info.capacity.block_size
        uncached = max(1, self.num_prompt_tokens - blocks * block_size)
        new_blocks = -(-self.num_prompt_tokens // block_size) - blocks
        room = record.load.free_kv_blocks >= new_blocks
        total = cost.uncached_weight * uncached + load
        self.scored[worker_id] = _Scored(record, blocks, total, room, key)


def _rank(s: _Scored) -> tuple:
    return (s.cost, -s.blocks, s.key)


def _tie(s: _Scored) -> tuple:
    return (s.cost, -s.blocks, s.key[0])


def _sample(matched: Mapping[str, int], k: int, u: float) -> list[tuple[str, int]]:
    if isinstance(matched, PrefixMatch):
        return matched.sample(k, u)
    ranked = sorted(matched.items(), key=lambda item: (-item[1], item[0]))
    return _spaced(ranked, k, u)


def _spaced(items: Sequence, k: int, u: float) -> list:
    """``k`` of ``items`` evenly spaced, starting at an offset set by ``u`` in [0, 1)."""
    if len(items) <= k:
        return list(items)
    step = len(items) / k
    return [items[int((i + u) * step)] for i in range(k)]


def unit_draw(request_id: str, purpose: bytes = b"tandem-route") -> float:
    """A number in [0, 1) fixed by the request id (and ``purpose``, at most 16 bytes):
    the same on every router replica."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=purpose).digest()
    return int.from_bytes(digest, "little") / 2**64
