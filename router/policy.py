"""Routing policies: which worker of a pool gets a request.

A policy answers one question, ``select(request, candidates)``, and answers it purely:
it reads the request and a snapshot of the pool's workers (``WorkerRecord``s, as the
registry watcher hands them out) and changes nothing. A policy that keeps state (the
round-robin cursor) changes it only in ``record(request, choice)``, which the caller
invokes once it has committed to a choice. So a test can ask "what would you pick?"
any number of times, and a dispatch that fails before it is committed leaves no trace.

Use one policy instance per pool (prefill, decode): state such as a cursor belongs to
the pool it walks. A prefix-aware policy fits the same interface: it reads
``request.block_hashes`` and the candidates, and takes its read-only KV-event index in
its constructor (the index is fed by workers' events, never by the policy).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.hashing import BlockHash
from tandem.registry import WorkerLoad, WorkerRecord, WorkerRole


class PolicyName(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may know about a request.

    ``block_hashes`` are the chained hashes of the prompt's full blocks
    (``tandem.hashing.hash_blocks``), empty when no policy in use needs them.
    ``priority``: lower runs first, as in ``GenerateRequest``.
    """

    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...] = ()
    priority: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens}")


class RoutingPolicy(Protocol):
    """Picks a worker for a request from a snapshot of one pool."""

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

    def __init__(self) -> None:
        self._last_worker_id: str | None = None  # None: nothing recorded yet

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        if not candidates:
            return None
        first = min(candidates, key=_worker_id)
        if self._last_worker_id is None:
            return first
        after = [c for c in candidates if c.info.worker_id > self._last_worker_id]
        return min(after, key=_worker_id) if after else first

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        self._last_worker_id = choice.info.worker_id


class LeastLoaded:
    """Picks the idlest worker by its last reported load; stateless.

    Prefill workers: fewest queued prefill tokens, then fewest waiting sequences.
    Decode workers: largest share of free KV blocks (free / capacity, so workers of
    different sizes compare fairly), then fewest running sequences. Remaining ties go
    to the smallest worker id, so equal loads always give the same answer.
    """

    def select(
        self, request: RoutingRequest, candidates: Sequence[WorkerRecord]
    ) -> WorkerRecord | None:
        return min(candidates, key=load_key, default=None)

    def record(self, request: RoutingRequest, choice: WorkerRecord) -> None:
        """Nothing to remember: the next load report reflects the request."""


def load_key(record: WorkerRecord) -> tuple[float, int, str]:
    """Sort key of a worker by load for its role: smaller is idler, worker id last."""
    load: WorkerLoad = record.load
    if record.info.role is WorkerRole.PREFILL:
        return (load.num_queued_prefill_tokens, load.num_waiting_seqs, record.info.worker_id)
    free_share = load.free_kv_blocks / record.info.capacity.num_kv_blocks
    return (-free_share, load.num_running_seqs, record.info.worker_id)


def make_policy(name: PolicyName) -> RoutingPolicy:
    """A fresh policy; make one per worker pool."""
    match name:
        case PolicyName.ROUND_ROBIN:
            return RoundRobin()
        case PolicyName.LEAST_LOADED:
            return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}")


def _worker_id(record: WorkerRecord) -> str:
    return record.info.worker_id
