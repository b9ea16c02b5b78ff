"""The router's KV index, kept in step with the workers' event streams.

``KVIndexer`` wraps a ``PrefixIndex`` with the bookkeeping that keeps it honest: per
worker, the incarnation (``epoch``) and the number of the last batch applied. It
changes only through typed inputs —

* ``worker_joined`` / ``worker_left``: registry membership (a worker that leaves is
  purged at once; events from a worker not in the registry are ignored);
* ``apply(batch)``: one ``EventBatch`` read from the stream;
* ``apply_snapshot(snapshot)``: a worker's ``CacheSnapshot``;

— and answers ``overlap(hashes)``. It does no I/O: when it needs a snapshot it says
so (the input returns ``True``, and ``syncing`` lists the workers waiting for one), and
the caller fetches it (``tandem.router.kv_index.consumer``; the fleet simulator calls the same
methods directly).

Resync protocol. A worker is *syncing* from the moment it joins until its snapshot is
applied, and again whenever a batch shows that something was lost: a number skipped,
a watermark ahead of what was applied, or a new incarnation that did not start at
batch 1. While syncing, its batches are buffered (at most ``max_buffered``, oldest
dropped) and its old entries keep answering queries; the snapshot replaces them, then
buffered batches numbered after the snapshot are replayed. Replaying a batch the
snapshot already reflects is harmless: every event sets a block's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.common.hashing import BlockHash
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, CacheCleared
from tandem.common.kv_events.wire import CacheSnapshot, EventBatch
from tandem.router.kv_index.index import PrefixIndex, PrefixMatch

DEFAULT_MAX_BUFFERED = 1024


@dataclass
class _WorkerSync:
    epoch: int | None = None
    seq: int = 0  # last batch applied (0: none)
    syncing: bool = True
    buffer: list[EventBatch] = field(default_factory=list)


@dataclass
class IndexerStats:
    batches_applied: int = 0
    events_applied: int = 0
    gaps: int = 0
    """Times lost events were detected (each leads to a resync)."""
    snapshots_applied: int = 0
    batches_ignored: int = 0
    """Batches from workers not in the registry, or from an older incarnation."""


class KVIndexer:
    def __init__(self, max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        self.index = PrefixIndex()
        self.stats = IndexerStats()
        self._max_buffered = max_buffered
        self._workers: dict[str, _WorkerSync] = {}

    # --- queries -----------------------------------------------------------------------

    def overlap(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """Worker id -> leading blocks of the prompt it holds (see ``PrefixIndex``)."""
        return self.index.overlap(block_hashes)

    @property
    def syncing(self) -> list[str]:
        """Workers waiting for a snapshot."""
        return [w for w, sync in self._workers.items() if sync.syncing]

    def is_syncing(self, worker_id: str) -> bool:
        sync = self._workers.get(worker_id)
        return sync is not None and sync.syncing

    def last_seq(self, worker_id: str) -> int | None:
        """Number of the last batch applied for a known worker (``None``: unknown)."""
        sync = self._workers.get(worker_id)
        return None if sync is None else sync.seq

    # --- inputs ------------------------------------------------------------------------

    def worker_joined(self, worker_id: str) -> bool:
        """A worker entered the registry. Returns ``True``: fetch its snapshot."""
        if worker_id in self._workers:
            return self._workers[worker_id].syncing
        self._workers[worker_id] = _WorkerSync()
        return True

    def worker_left(self, worker_id: str) -> None:
        """A worker left the registry: forget it and everything it held, now."""
        self._workers.pop(worker_id, None)
        self.index.drop_worker(worker_id)

    def resync_all(self) -> list[str]:
        """Mark every known worker as syncing (e.g. the stream was reset); returns them."""
        for sync in self._workers.values():
            self._start_sync(sync, None)
        return list(self._workers)

    def apply(self, batch: EventBatch) -> bool:
        """Apply one batch from the stream. Returns ``True`` when the worker must now be
        resynced (its snapshot fetched)."""
        sync = self._workers.get(batch.worker_id)
        if sync is None:
            self.stats.batches_ignored += 1
            return False
        if sync.syncing:
            self._buffer(sync, batch)
            return False
        return self._apply_live(batch.worker_id, sync, batch)

    def apply_snapshot(self, snapshot: CacheSnapshot) -> bool:
        """Replace a syncing worker's entries with its snapshot and replay what was
        buffered. Returns ``True`` when the replay found another gap (fetch again).
        A snapshot for a worker that is not syncing (or not known) is ignored."""
        sync = self._workers.get(snapshot.worker_id)
        if sync is None or not sync.syncing:
            return False
        self.index.replace_worker(snapshot.worker_id, snapshot.block_hashes)
        self.stats.snapshots_applied += 1
        sync.epoch, sync.seq, sync.syncing = snapshot.epoch, snapshot.seq, False
        buffered, sync.buffer = sync.buffer, []
        for i, batch in enumerate(buffered):
            if self._apply_live(snapshot.worker_id, sync, batch):
                sync.buffer = buffered[i + 1 :]
                return True
        return False

    # --- helpers -----------------------------------------------------------------------

    def _apply_live(self, worker_id: str, sync: _WorkerSync, batch: EventBatch) -> bool:
        if batch.epoch != sync.epoch:
            if sync.epoch is not None and batch.epoch < sync.epoch:
                self.stats.batches_ignored += 1  # left over from an older incarnation
                return False
            # A new incarnation: its cache started empty at batch 1.
            self.index.clear_worker(worker_id)
            sync.epoch, sync.seq = batch.epoch, 0
        if batch.seq <= sync.seq:
            return False  # already applied, or a watermark agreeing with us
        if batch.seq > sync.seq + 1 or batch.is_watermark:
            self.stats.gaps += 1
            self._start_sync(sync, batch)
            return True
        self._apply_events(worker_id, batch)
        sync.seq = batch.seq
        return False

    def _apply_events(self, worker_id: str, batch: EventBatch) -> None:
        index = self.index
        for event in batch.events:
            if isinstance(event, BlocksStored):
                index.add(worker_id, event.block_hashes)
            elif isinstance(event, BlocksEvicted):
                index.remove(worker_id, event.block_hashes)
            elif isinstance(event, CacheCleared):
                index.clear_worker(worker_id)
        self.stats.batches_applied += 1
        self.stats.events_applied += len(batch.events)

    def _start_sync(self, sync: _WorkerSync, batch: EventBatch | None) -> None:
        sync.syncing = True
        sync.buffer = []
        if batch is not None:
            self._buffer(sync, batch)

    def _buffer(self, sync: _WorkerSync, batch: EventBatch) -> None:
        if batch.is_watermark:
            return  # says nothing a snapshot will not
        if len(sync.buffer) >= self._max_buffered:
            del sync.buffer[0]  # the replay will notice the hole and resync again
        sync.buffer.append(batch)
