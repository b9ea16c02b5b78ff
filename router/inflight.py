"""Load this router has sent to workers, merged into their reported load.

Workers report their load through the registry once per heartbeat (every second by
default). Requests routed in between would all see the same numbers and pile onto the
same worker, so the router also counts what it sends itself: a prefill's uncached
prompt tokens until its ``Prefill`` call returns, a decode stream's sequence and KV
blocks until the stream ends. ``adjust`` merges the two for the policies:

* a report older than this router's last change on that worker is stale: the
  router's own count stands alone (exact with one router);
* a fresher report also counts other routers' work: the larger of the two stands
  (free KV blocks: the smaller).

Torch-free; used on the event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.registry import WorkerRecord


@dataclass(frozen=True)
class Ticket:
    """One piece of work in flight on ``worker_id``; hand it back to ``end``."""

    worker_id: str
    prefill_tokens: int = 0
    decode_blocks: int = 0
    is_decode: bool = False


@dataclass
class _Counts:
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_seqs: int = 0
    decode_blocks: int = 0
    changed_at: float = 0.0


class InflightLoad:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall-clock seconds, comparable with ``WorkerLoad.updated_at``."""
        self._clock = clock
        self._counts: dict[str, _Counts] = {}

    def begin_prefill(self, worker_id: str, uncached_tokens: int) -> Ticket:
        ticket = Ticket(worker_id, prefill_tokens=uncached_tokens)
        self._change(ticket, +1)
        return ticket

    def begin_decode(self, worker_id: str, kv_blocks: int) -> Ticket:
        ticket = Ticket(worker_id, decode_blocks=kv_blocks, is_decode=True)
        self._change(ticket, +1)
        return ticket

    def end(self, ticket: Ticket) -> None:
        self._change(ticket, -1)

    def forget(self, worker_id: str) -> None:
        """The worker left: drop its counts (tickets still out end as no-ops)."""
        self._counts.pop(worker_id, None)

    def adjust(self, records: Sequence[WorkerRecord]) -> list[WorkerRecord]:
        """``records`` with this router's in-flight work merged into their load."""
        counts = self._counts
        return [r if r.info.worker_id not in counts else self._merge(r) for r in records]

    def _merge(self, record: WorkerRecord) -> WorkerRecord:
        mine = self._counts[record.info.worker_id]
        load = record.load
        own_free = max(0, record.info.capacity.num_kv_blocks - mine.decode_blocks)
        if load.updated_at < mine.changed_at:  # the report predates our last change
            merged = replace(
                load,
                num_queued_prefill_tokens=mine.prefill_tokens,
                num_waiting_seqs=mine.prefill_requests,
                num_running_seqs=mine.decode_seqs,
                free_kv_blocks=own_free,
            )
        else:
            merged = replace(
                load,
                num_queued_prefill_tokens=max(load.num_queued_prefill_tokens, mine.prefill_tokens),
                num_waiting_seqs=max(load.num_waiting_seqs, mine.prefill_requests),
                num_running_seqs=max(load.num_running_seqs, mine.decode_seqs),
                free_kv_blocks=min(load.free_kv_blocks, own_free),
            )
        return replace(record, load=merged)

    def _change(self, ticket: Ticket, sign: int) -> None:
        counts = self._counts.get(ticket.worker_id)
        if counts is None:
            if sign < 0:
                return  # the worker left meanwhile
            counts = self._counts[ticket.worker_id] = _Counts()
        # Clamped: a ticket from before a worker left and rejoined must not go negative.
        if ticket.is_decode:
            counts.decode_seqs = max(0, counts.decode_seqs + sign)
            counts.decode_blocks = max(0, counts.decode_blocks + sign * ticket.decode_blocks)
        else:
            counts.prefill_requests = max(0, counts.prefill_requests + sign)
            counts.prefill_tokens = max(0, counts.prefill_tokens + sign * ticket.prefill_tokens)
        counts.changed_at = self._clock()  # kept when back to zero: it dates the reports
