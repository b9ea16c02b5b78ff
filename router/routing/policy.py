"""Routing policies: which worker of a pool gets a request.

A policy answers one question and answers it purely: ``choose(request, pool)`` reads
the request and a read-only view of one pool (``tandem.router.routing.pool_view.PoolView``) and
changes nothing; ``select(request, candidates)`` is the same question over a plain
list of ``WorkerRecord``s (as the registry watcher hands them out). A policy that keeps
state (the round-robin cursor) changes it only in ``record(request, choice)``, which
the caller invokes once it has committed to a choice. So a test can ask "what would
you pick?" any number of times, and a dispatch that fails before it is committed
leaves no trace.

Use one policy instance per pool (prefill, decode): state such as a cursor belongs to
the pool it walks. The prefix-aware policy (``tandem.router.routing.prefix_aware``) reads
``request.matched_blocks`` — the KV index's answer for this prompt, computed by the
caller right before it asks — so its decision too is a pure function of (request,
pool snapshot, index answer).

Policies (``--prefill-policy`` / ``--decode-policy``): ``round_robin``,
``least_loaded``, ``prefix_aware`` (the default).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.common.hashing import BlockHash
from tandem.common.registry import WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.kv_index.index import EMPTY_MATCH
from tandem.router.routing.pool_view import ListPool, PoolView
from tandem.router.routing.prefix_aware import PrefixAwarePolicy, PrefixCost


class PolicyName(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may know about a request.

    ``block_hashes`` are the chained hashes of the prompt's full blocks
    (``tandem.common.hashing.hash_blocks``), empty when no policy in use needs them.
    ``priority``: lower runs first, as in ``GenerateRequest``. ``matched_blocks`` is
    the KV index's answer for ``block_hashes``: worker id -> leading blocks of the
    prompt that worker holds (absent: none); empty when no index is consulted.
    ``lora_name``: the LoRA adapter it runs under (the caller offers a policy only the
    workers that hold it; its block hashes are rooted in the adapter's namespace).
    """

    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...] = ()
    priority: int = 0
    matched_blocks: Mapping[str, int] = field(default_factory=lambda: EMPTY_MATCH, compare=False)
    lora_name: str | None = None
    lora_namespace: str = ""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens}")


class RoutingPolicy(Protocol):
    """Picks a worker for a request from a snapshot of one pool."""

    name: str
    """The policy's name in metrics (a ``PolicyName`` value)."""
    uses_prefix_match: bool
    """Whether ``choose`` reads ``request.matched_blocks`` (the caller then fills it)."""

    def load_key(self, record: WorkerRecord) -> tuple:
        """The order in which this policy wants a pool view to rank workers (see
        ``tandem.router.routing.pool_view``)."""
        ...

    def choose(self, request: RoutingRequest, pool: PoolView) -> WorkerRecord | None:
        """The chosen worker, or ``None`` only when the pool is empty. Pure."""
        ...

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        """The chosen candidate, or ``None`` only when ``candidates`` is empty.

        Pure: reads ``request``, ``candidates`` and the policy's state, changes nothing.
        The result does not depend on the order of ``candidates``. Called once per
        dispatch attempt on the request path, so it is O(len(candidates)).
        """
        ...

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        """Note that ``request`` was sent to ``choice`` (a result of ``select``).

        Call it right after committing to the choice, before the next ``select``
        (no ``await`` in between, or concurrent requests all get the same answer).
        """
        ...


class RoundRobin:
    """Cycles through the pool in worker-id order.

    The cursor is the id of the last recorded worker, not an index, so workers joining
    or leaving do not make it skip or repeat the others: the next choice is the first
    candidate whose id sorts after the cursor, wrapping around to the smallest id.
    """

    name = "round_robin"
    uses_prefix_match = False

    def __init__(self) -> None:
        self._last_worker_id: str | None = None  # None: nothing recorded yet

    def load_key(self, record: WorkerRecord) -> tuple:
        return load_key(record)

    def choose(self, request: RoutingRequest, pool: PoolView) -> WorkerRecord | None:
        return pool.first_after(self._last_worker_id)

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        return self.choose(request, ListPool(candidates))

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        self._last_worker_id = choice.info.worker_id


class LeastLoaded:
    """Picks the idlest worker by its last reported load; stateless.

    Prefill workers: fewest queued prefill tokens, then fewest waiting sequences.
    Decode workers: largest share of free KV blocks (free / capacity, so workers of
    different sizes compare fairly), then fewest running sequences. Remaining ties go
    to the smallest worker id, so equal loads always give the same answer.
    """

    name = "least_loaded"
    uses_prefix_match = False

    def load_key(self, record: WorkerRecord) -> tuple:
        return load_key(record)

    def choose(self, request: RoutingRequest, pool: PoolView) -> WorkerRecord | None:
        best = pool.cheapest(1)
        return best[0] if best else None

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        return self.choose(request, ListPool(candidates, load_key))

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        """Nothing to remember: the next load report reflects the request."""


def load_key(record: WorkerRecord) -> tuple[float, int, str]:
    """Sort key of a worker by load for its role: smaller is idler, worker id last."""
    load: WorkerLoad = record.load
    if record.info.role is WorkerRole.PREFILL:
        return (load.num_queued_prefill_tokens, load.num_waiting_seqs, record.info.worker_id)
    free_share = load.free_kv_blocks / record.info.capacity.num_kv_blocks
    return (-free_share, load.num_running_seqs, record.info.worker_id)


def make_policy(
    name: PolicyName, role: WorkerRole = WorkerRole.PREFILL, cost: PrefixCost | None = None
) -> RoutingPolicy:
    """A fresh policy for the pool of ``role``; make one per worker pool. ``cost``
    overrides the prefix-aware policy's defaults for that role."""
    match name:
        case PolicyName.ROUND_ROBIN:
            return RoundRobin()
        case PolicyName.LEAST_LOADED:
            return LeastLoaded()
        case PolicyName.PREFIX_AWARE:
            return PrefixAwarePolicy(cost or PrefixCost.default_for(role))
    raise ValueError(f"unknown routing policy {name!r}")
