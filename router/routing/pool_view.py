"""What a routing policy reads about one pool of workers when it decides.

A policy asks a handful of questions — a worker by id, the next worker after an id,
the least loaded few by the policy's own load order, the pool's mean load, an idle
worker — and ``PoolView`` is those questions. Two answers:

* ``ListPool`` builds them from a plain list of ``WorkerRecord``s, O(n) per decision:
  for ``RoutingPolicy.select`` and for retries that exclude workers;
* ``IndexedPool`` keeps them up to date as records change — a heap of (load key,
  version, id) entries with lazy deletion, a running sum for the mean, sorted ids and
  sorted idle ids — so a decision costs O(log n) whatever the pool size. The router
  keeps one per pool (updated when the registry snapshot or its own in-flight work
  changes) and the fleet simulator drives a thousand workers through the same class.

A *load key* orders workers for a policy: a tuple whose first element is the worker's
load as a number (the pool's mean of it feeds load guards) and whose last element is
the worker id (so the order is total and does not depend on list order).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from tandem.common.registry import WorkerRecord

LoadKey = Callable[[WorkerRecord], tuple]
"""``key(record)``: (load as a number, ..., worker id); smaller is idler."""


class PoolView(Protocol):
    """A read-only snapshot of one pool, for one decision."""

    def __len__(self) -> int: ...

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The worker ``worker_id`` if it is in the pool."""
        ...

    def first_after(self, worker_id: str | None) -> WorkerRecord | None:
        """The worker with the smallest id greater than ``worker_id``, wrapping around
        to the smallest id (``None``: the smallest id). ``None`` only when empty."""
        ...

    def cheapest(self, n: int, skip: Collection[str] = ()) -> list[WorkerRecord]:
        """Up to ``n`` workers not in ``skip``, least loaded first (by the view's key)."""
        ...

    def mean_load(self) -> float:
        """Mean of the key's first element over the pool (0.0 when empty)."""
        ...

    def mean_busy(self) -> float:
        """Mean of the workers' reported ``busy_fraction`` (0.0 when empty)."""
        ...

    def idle_at(self, u: float) -> WorkerRecord | None:
        """Of the ``k`` idle workers (key's first element 0) in id order, the one at
        position ``floor(u * k)`` for ``u`` in [0, 1); ``None`` when none is idle."""
        ...


class ListPool:
    """``PoolView`` over a sequence of records; built per decision in O(n)."""

    def __init__(self, records: Sequence[WorkerRecord], key: LoadKey | None = None) -> None:
        """``key=None``: a view for policies that never ask for load (round robin)."""
        self._by_id = {r.info.worker_id: r for r in records}
        self._ids = sorted(self._by_id)
        self._key = key
        self._keyed: list[tuple[tuple, WorkerRecord]] | None = None
        self._idle: list[WorkerRecord] | None = None

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._by_id.get(worker_id)

    def first_after(self, worker_id: str | None) -> WorkerRecord | None:
        if not self._ids:
            return None
        i = 0 if worker_id is None else bisect.bisect_right(self._ids, worker_id)
        return self._by_id[self._ids[i % len(self._ids)]]

    def cheapest(self, n: int, skip: Collection[str] = ()) -> list[WorkerRecord]:
        keyed = self._keyed_records()
        if skip:
            keyed = [kr for kr in keyed if kr[1].info.worker_id not in skip]
        return [record for _, record in heapq.nsmallest(n, keyed, key=_first)]

    def mean_load(self) -> float:
        keyed = self._keyed_records()
        return sum(k[0] for k, _ in keyed) / len(keyed) if keyed else 0.0

    def mean_busy(self) -> float:
        records = self._by_id.values()
        return sum(r.load.busy_fraction for r in records) / len(records) if records else 0.0

    def idle_at(self, u: float) -> WorkerRecord | None:
        if self._idle is None:
            idle = sorted((r.info.worker_id, r) for k, r in self._keyed_records() if k[0] == 0)
            self._idle = [r for _, r in idle]
        return self._idle[int(u * len(self._idle))] if self._idle else None

    def _keyed_records(self) -> list[tuple[tuple, WorkerRecord]]:
        if self._keyed is None:
            if self._key is None:
                raise TypeError("this pool view was built without a load key")
            key = self._key
            self._keyed = [(key(r), r) for r in self._by_id.values()]
        return self._keyed


def _first(item: tuple[tuple, WorkerRecord]) -> tuple:
    return item[0]


class IndexedPool:
    """``PoolView`` maintained incrementally: ``update`` / ``remove`` are O(log n) (the
    sorted id lists O(n) memmoves), queries O(log n) plus what they return."""

    def __init__(self, key: LoadKey) -> None:
        self._key = key
        self._records: dict[str, WorkerRecord] = {}
        self._version: dict[str, int] = {}
        self._loads: dict[str, float] = {}
        self._total = 0.0
        self._busy_total = 0.0
        self._heap: list[tuple[tuple, int, str]] = []
        self._ids: list[str] = []
        self._idle: list[str] = []  # sorted ids of workers whose load is 0

    def update(self, record: WorkerRecord) -> None:
        """Add ``record``'s worker or replace its record."""
        worker_id = record.info.worker_id
        if worker_id not in self._records:
            bisect.insort(self._ids, worker_id)
        key = self._key(record)
        old = self._records.get(worker_id)
        self._busy_total += record.load.busy_fraction - (old.load.busy_fraction if old else 0.0)
        self._records[worker_id] = record
        version = self._version.get(worker_id, 0) + 1
        self._version[worker_id] = version
        self._set_load(worker_id, key[0])
        heapq.heappush(self._heap, (key, version, worker_id))
        if len(self._heap) > 4 * len(self._records) + 64:
            self._compact()

    def remove(self, worker_id: str) -> None:
        record = self._records.pop(worker_id, None)
        if record is None:
            return
        self._busy_total -= record.load.busy_fraction
        self._ids.remove(worker_id)
        self._set_load(worker_id, None)
        self._version[worker_id] = self._version.get(worker_id, 0) + 1  # outdates its entries

    def replace_all(self, records: Iterable[WorkerRecord]) -> None:
        """Make ``records`` the whole pool (workers not among them are removed)."""
        fresh = {r.info.worker_id: r for r in records}
        for worker_id in [w for w in self._records if w not in fresh]:
            self.remove(worker_id)
        for record in fresh.values():
            if self._records.get(record.info.worker_id) is not record:
                self.update(record)

    # --- PoolView ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._records)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def first_after(self, worker_id: str | None) -> WorkerRecord | None:
        if not self._ids:
            return None
        i = 0 if worker_id is None else bisect.bisect_right(self._ids, worker_id)
        return self._records[self._ids[i % len(self._ids)]]

    def cheapest(self, n: int, skip: Collection[str] = ()) -> list[WorkerRecord]:
        heap, version = self._heap, self._version
        kept: list[tuple[tuple, int, str]] = []
        out: list[WorkerRecord] = []
        while heap and len(out) < n:
            entry = heapq.heappop(heap)
            if version.get(entry[2]) != entry[1] or entry[2] not in self._records:
                continue  # outdated by a later update, or removed
            kept.append(entry)
            if entry[2] not in skip:
                out.append(self._records[entry[2]])
        for entry in kept:
            heapq.heappush(heap, entry)
        return out

    def mean_load(self) -> float:
        return self._total / len(self._records) if self._records else 0.0

    def mean_busy(self) -> float:
        return max(0.0, self._busy_total) / len(self._records) if self._records else 0.0

    def idle_at(self, u: float) -> WorkerRecord | None:
        idle = self._idle
        return self._records[idle[int(u * len(idle))]] if idle else None

    # --- helpers -----------------------------------------------------------------------

    def _set_load(self, worker_id: str, load: float | None) -> None:
        old = self._loads.pop(worker_id, None)
        self._total -= old or 0.0
        if old == 0:
            self._idle.remove(worker_id)
        if load is None:
            return
        self._loads[worker_id] = load
        self._total += load
        if load == 0:
            bisect.insort(self._idle, worker_id)

    def _compact(self) -> None:
        self._heap = [(self._key(r), self._version[w], w) for w, r in self._records.items()]
        heapq.heapify(self._heap)
