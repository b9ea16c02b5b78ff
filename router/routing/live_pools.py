"""The pool views the router's policies read, kept in step instead of rebuilt.

One ``IndexedPool`` per role holds each worker's *effective* record: its registry
report merged with the work this router has in flight there (``InflightLoad``). It is
resynced when the registry snapshot changes (the watcher hands out a new tuple after
each read, twice a second by default) and updated for one worker whenever this router
starts or ends work on it. So a decision costs O(log n) in the pool size instead of
rebuilding an O(n) view per request. A pick that excludes workers (a retry) gets a
``ListPool`` over the rest. Torch-free; event loop only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tandem.common.registry import RegistryWatcher, WorkerRecord, WorkerRole
from tandem.router.routing.inflight import InflightLoad, Ticket
from tandem.router.routing.pool_view import IndexedPool, ListPool, LoadKey, PoolView


class LivePools:
    def __init__(
        self,
        watcher: RegistryWatcher,
        inflight: InflightLoad,
        keys: Mapping[WorkerRole, LoadKey],
    ) -> None:
        """``keys``: the load order each role's policy wants (``policy.load_key``)."""
        self.watcher = watcher
        self.inflight = inflight
        self._keys = dict(keys)
        self._pools = {role: IndexedPool(key) for role, key in self._keys.items()}
        self._synced: dict[WorkerRole, tuple[WorkerRecord, ...] | None] = dict.fromkeys(self._keys)

    def view(self, role: WorkerRole, exclude: Collection[str] = ()) -> PoolView:
        """The live workers of ``role`` but ``exclude``, with in-flight work merged in."""
        records = self.watcher.workers(role)
        if exclude:
            kept = [r for r in records if r.info.worker_id not in exclude]
            return ListPool(self.inflight.adjust(kept), self._keys[role])
        if records is not self._synced[role]:
            self._pools[role].replace_all(self.inflight.adjust(records))
            self._synced[role] = records
        return self._pools[role]

    def begin_prefill(self, worker_id: str, uncached_tokens: int) -> Ticket:
        ticket = self.inflight.begin_prefill(worker_id, uncached_tokens)
        self._refresh(worker_id)
        return ticket

    def begin_decode(self, worker_id: str, kv_blocks: int) -> Ticket:
        ticket = self.inflight.begin_decode(worker_id, kv_blocks)
        self._refresh(worker_id)
        return ticket

    def end(self, ticket: Ticket) -> None:
        self.inflight.end(ticket)
        self._refresh(ticket.worker_id)

    def _refresh(self, worker_id: str) -> None:
        record = self.watcher.get(worker_id)
        if record is None:
            return
        role = record.info.role
        synced = self._synced.get(role)
        if synced is not None and record in synced:
            self._pools[role].update(self.inflight.adjust([record])[0])
