"""Load this router has sent to workers, merged into their reported load.

Workers report their load through the registry once per heartbeat (every second by
default). Requests routed in between would all see the same numbers and pile onto the
same worker, so the router also counts what it sends itself: a prefill's uncached
prompt tokens until its ``Prefill`` call returns, a decode stream's sequence and KV
blocks until the stream ends. ``adjust`` merges the two for the policies.

**Prefill workers**: the report brought up to now. A report from time ``t`` is exact
as of ``t`` (the worker knows what it found cached and what it has computed, which the
router's count only estimates); to it the router adds the change of its own count
since ``t`` (what it sent since, less what came back), kept per worker as a
``PrefillLedger``:

    queued(now) = reported queued(t) + mine(now) - mine(t)          (at least 0)

So a new report corrects the router's estimates, work sent since counts at once, and
other routers' work counts as of their last report. The reported busy share (a decayed
average over ``BUSY_WINDOW_S``, see ``tandem.common.worker_load.BusyMeter``) is brought up to
now the same way: a holder of a hot prefix that reported just under the busy guard's
limit would otherwise take every hot request until its next report. Over the ``e``
seconds since the report, of which this router had work in flight there ``o`` (a
prefill worker with work is stepping), the worker's meter moves to

    busy = max(reported, k * reported + (1 - k) * o / e),    k = exp(-e / window)

Only upwards: what other routers sent it is not seen until the next report, so a
worker idle to this router is left where it reported.

**Decode workers**: a report older than this router's last change on that worker is
stale and the router's own count stands alone (exact with one router); a fresher one
also counts other routers' streams: the larger of the two stands (free KV blocks: the
smaller).

Clocks: ``t`` is the worker's clock, compared with this router's (NTP-synced hosts).

Torch-free; used on the event loop only.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from tandem.common.registry import BUSY_WINDOW_S, WorkerLoad, WorkerRecord, WorkerRole


@dataclass(frozen=True)
class Ticket:
    """One piece of work in flight on ``worker_id``; hand it back to ``end``."""

    worker_id: str
    prefill_tokens: int = 0
    decode_blocks: int = 0
    is_decode: bool = False


class PrefillLedger:
    """This router's prefill work on one worker over time, so a report from time ``t``
    can be brought up to now: ``at(t)`` is what this router had in flight there at
    ``t`` (tokens, requests) and the seconds it had any in flight up to ``t``. Kept as
    one entry per change, pruned to what reports can still ask about
    (``forget_before``) and to ``keep_s`` of history."""

    __slots__ = ("_busy", "_complete", "_requests", "_times", "_tokens", "keep_s")

    def __init__(self, keep_s: float = 2 * BUSY_WINDOW_S) -> None:
        self._times: list[float] = []
        self._tokens: list[int] = []  # in flight after the change
        self._requests: list[int] = []
        self._busy: list[float] = []  # seconds with work in flight before the change
        self._complete = True  # nothing pruned: before the first entry nothing was in flight
        self.keep_s = keep_s

    def record(self, now: float, tokens: int, requests: int) -> None:
        """In flight from ``now`` on (after a change)."""
        busy = self._busy_at(now) if self._times else 0.0
        self._times.append(now)
        self._tokens.append(tokens)
        self._requests.append(requests)
        self._busy.append(busy)
        if len(self._times) > 64 and self._times[0] < now - self.keep_s:
            self.forget_before(now - self.keep_s)

    def at(self, t: float) -> tuple[int, int, float] | None:
        """(tokens, requests) in flight at ``t`` and seconds with any in flight up to
        ``t``; ``None`` when ``t`` is older than what is kept."""
        i = bisect.bisect_right(self._times, t) - 1
        if i < 0:
            return (0, 0, 0.0) if self._complete else None
        return self._tokens[i], self._requests[i], self._busy_at(t, i)

    def busy_seconds(self, now: float) -> float:
        return self._busy_at(now) if self._times else 0.0

    def forget_before(self, t: float) -> None:
        """Drop what ``at`` no longer needs for times from ``t`` on."""
        i = bisect.bisect_right(self._times, t) - 1  # the last change at or before t
        if i > 0:
            for column in (self._times, self._tokens, self._requests, self._busy):
                del column[:i]
            self._complete = False

    def _busy_at(self, t: float, i: int = -1) -> float:
        busy = self._busy[i]
        return busy + max(0.0, t - self._times[i]) if self._requests[i] else busy


def predicted_busy(reported: float, occupied_s: float, elapsed_s: float, window_s: float) -> float:
    """The busy share a worker's meter will show ``elapsed_s`` after reporting
    ``reported``, given it was busy ``occupied_s`` of them; never below ``reported``."""
    if elapsed_s <= 0 or occupied_s <= 0:
        return reported
    keep = math.exp(-elapsed_s / window_s)
    share = min(1.0, occupied_s / elapsed_s)
    return max(reported, keep * reported + (1 - keep) * share)


@dataclass
class _Counts:
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_seqs: int = 0
    decode_blocks: int = 0
    changed_at: float = 0.0
    prefill: PrefillLedger = field(default_factory=PrefillLedger)


class InflightLoad:
    def __init__(
        self, clock: Callable[[], float] = time.time, busy_window_s: float = BUSY_WINDOW_S
    ) -> None:
        """``clock``: wall-clock seconds, comparable with ``WorkerLoad.updated_at``;
        ``busy_window_s``: the time constant of the workers' busy meter."""
        self._clock = clock
        self.busy_window_s = busy_window_s
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
        if record.info.role is WorkerRole.PREFILL:
            merged = self._merge_prefill(mine, load)
        else:
            own_free = max(0, record.info.capacity.num_kv_blocks - mine.decode_blocks)
            if load.updated_at < mine.changed_at:  # the report predates our last change
                merged = replace(load, num_running_seqs=mine.decode_seqs, free_kv_blocks=own_free)
            else:
                merged = replace(
                    load,
                    num_running_seqs=max(load.num_running_seqs, mine.decode_seqs),
                    free_kv_blocks=min(load.free_kv_blocks, own_free),
                )
        return replace(record, load=merged)

    def _merge_prefill(self, mine: _Counts, load: WorkerLoad) -> WorkerLoad:
        ledger, reported_at, now = mine.prefill, load.updated_at, self._clock()
        ledger.forget_before(reported_at)
        then = ledger.at(reported_at)
        if then is None:  # a report older than what is kept: this router's count alone
            return replace(
                load,
                num_queued_prefill_tokens=mine.prefill_tokens,
                num_waiting_seqs=mine.prefill_requests,
            )
        tokens, requests, busy_then = then
        busy = predicted_busy(
            load.busy_fraction,
            ledger.busy_seconds(now) - busy_then,
            now - reported_at,
            self.busy_window_s,
        )
        # A worker this router has work on is not idle, whatever the estimates say.
        floor = 1 if mine.prefill_requests else 0
        return replace(
            load,
            num_queued_prefill_tokens=max(
                floor, load.num_queued_prefill_tokens + mine.prefill_tokens - tokens
            ),
            num_waiting_seqs=max(floor, load.num_waiting_seqs + mine.prefill_requests - requests),
            busy_fraction=busy,
        )

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
        now = counts.changed_at = self._clock()  # kept when back to zero: it dates the reports
        if not ticket.is_decode:
            counts.prefill.record(now, counts.prefill_tokens, counts.prefill_requests)
