"""Feeds the router's ``KVIndexer``: the model's KV event stream, and worker snapshots.

* ``start()`` notes where the stream ends and reads on from there in the background
  (``XREAD BLOCK``). Older entries are not replayed: a router that starts — restarted,
  or a new replica — learns what workers already hold from their snapshots.
* ``worker_joined`` / ``worker_left`` are the registry watcher's callbacks. A worker
  that joins (every worker does, at the router's first registry read) is snapshotted
  through its ``ListCachedBlocks`` RPC; one that leaves is purged from the index at once.
* Whenever the indexer finds a gap in a worker's batch numbers it asks for another
  snapshot; fetches are retried with backoff while the worker stays registered.
* If Redis comes back with a stream older than the router's position (a Redis
  restart), reading starts over from the beginning and every worker is resynced.

Everything runs on the router's event loop, so the index never changes under a
decision (which has no ``await``). Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from tandem.common.kv_events.wire import (
    STREAM_FIELD,
    CacheSnapshot,
    KVEventDecodeError,
    decode_batch,
    kv_event_stream,
    snapshot_from_proto,
)
from tandem.common.registry import DEFAULT_PREFIX, WorkerRecord, WorkerRole
from tandem.common.registry.redis_io import REDIS_ERRORS, FailureLog, connect
from tandem.protos import worker_pb2
from tandem.router.clients import WorkerClients
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.metrics import RouterMetrics

SnapshotFetcher = Callable[[WorkerRecord], Awaitable[CacheSnapshot]]

READ_BLOCK_MS = 1000
READ_COUNT = 512
SNAPSHOT_TIMEOUT_S = 10.0
_RETRY_FIRST_S, _RETRY_MAX_S = 0.1, 2.0
_START_ID = b"0-0"

log = logging.getLogger(__name__)


def grpc_snapshot_fetcher(clients: WorkerClients) -> SnapshotFetcher:
    """Fetch snapshots with the workers' ``ListCachedBlocks`` RPC."""

    async def fetch(record: WorkerRecord) -> CacheSnapshot:
        stub = (
            clients.prefill(record)
            if record.info.role is WorkerRole.PREFILL
            else clients.decode(record)
        )
        response = await stub.ListCachedBlocks(
            worker_pb2.ListCachedBlocksRequest(), timeout=SNAPSHOT_TIMEOUT_S
        )
        return snapshot_from_proto(response)

    return fetch


class KVEventConsumer:
    def __init__(
        self,
        redis_url: str,
        model: str,
        indexer: KVIndexer,
        fetch_snapshot: SnapshotFetcher,
        metrics: RouterMetrics,
        *,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.indexer = indexer
        self.metrics = metrics
        self.stream = kv_event_stream(model, prefix)
        self._client = connect(redis_url)
        self._fetch_snapshot = fetch_snapshot
        self._records: dict[str, WorkerRecord] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._position = _START_ID
        self._reader: asyncio.Task[None] | None = None
        self._bad_entry_logged = False

    async def start(self) -> None:
        """Start reading at the stream's current end (or its start, if unreachable)."""
        if self._reader is not None:
            raise RuntimeError("consumer already started")
        with contextlib.suppress(*REDIS_ERRORS):
            self._position = await self._stream_end()
        self._reader = asyncio.create_task(self._read_loop(), name="kv-event-reader")

    async def stop(self) -> None:
        tasks = [t for t in (self._reader, *self._fetching.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reader = None
        self._fetching.clear()
        await self._client.aclose()

    # --- registry callbacks (event loop, must not block) -------------------------------

    def worker_joined(self, record: WorkerRecord) -> None:
        worker_id = record.info.worker_id
        self._records[worker_id] = record
        if self.indexer.worker_joined(worker_id):
            self._resync(worker_id)

    def worker_left(self, record: WorkerRecord) -> None:
        worker_id = record.info.worker_id
        self._records.pop(worker_id, None)
        self.indexer.worker_left(worker_id)
        task = self._fetching.pop(worker_id, None)
        if task is not None:
            task.cancel()

    # --- the stream --------------------------------------------------------------------

    async def _read_loop(self) -> None:
        failures = FailureLog(f"KV event stream {self.stream!r}")
        broken = False
        while True:
            try:
                if broken:
                    await self._check_stream_reset()
                reply = await self._client.xread(
                    {self.stream: self._position}, count=READ_COUNT, block=READ_BLOCK_MS
                )
                failures.succeeded()
                broken = False
            except REDIS_ERRORS as err:
                failures.failed(err)
                broken = True
                await asyncio.sleep(_RETRY_FIRST_S)
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self._position = entry_id
                    self._handle(fields.get(STREAM_FIELD, b""))

    def _handle(self, raw: bytes) -> None:
        try:
            batch = decode_batch(raw)
        except KVEventDecodeError as err:
            self.metrics.event_batches_undecodable.inc()
            if not self._bad_entry_logged:
                log.warning("skipping unreadable KV event entries in %s: %s", self.stream, err)
                self._bad_entry_logged = True
            return
        self.metrics.event_batches_read.inc()
        if batch.published_at:
            self.metrics.event_lag_seconds.observe(max(0.0, time.time() - batch.published_at))
        if self.indexer.apply(batch):
            self._resync(batch.worker_id)

    async def _stream_end(self) -> bytes:
        last = await self._client.xrevrange(self.stream, count=1)
        return last[0][0] if last else _START_ID

    async def _check_stream_reset(self) -> None:
        """After an outage: a stream that ends before our position was recreated."""
        end = await self._stream_end()
        if _entry_id(end) < _entry_id(self._position):
            log.warning("KV event stream %s was reset; resyncing every worker", self.stream)
            self._position = _START_ID
            for worker_id in self.indexer.resync_all():
                self._resync(worker_id)

    # --- snapshots ---------------------------------------------------------------------

    def _resync(self, worker_id: str) -> None:
        if worker_id in self._fetching or worker_id not in self._records:
            return
        task = asyncio.get_running_loop().create_task(
            self._fetch_until_synced(worker_id), name=f"kv-snapshot-{worker_id}"
        )
        self._fetching[worker_id] = task
        task.add_done_callback(self._fetch_done)

    def _fetch_done(self, task: asyncio.Task[None]) -> None:
        for worker_id, running in list(self._fetching.items()):
            if running is task:
                del self._fetching[worker_id]

    async def _fetch_until_synced(self, worker_id: str) -> None:
        delay = _RETRY_FIRST_S
        while self.indexer.is_syncing(worker_id):
            record = self._records.get(worker_id)
            if record is None:
                return
            try:
                snapshot = await self._fetch_snapshot(record)
            except (grpc.aio.AioRpcError, KVEventDecodeError) as err:
                self.metrics.snapshot_failures.inc()
                log.warning("snapshot of %s failed (%s); retrying", worker_id, _describe(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            self.metrics.snapshots_fetched.inc()
            if snapshot.worker_id != worker_id:
                log.error("worker %s answered with a snapshot of %s", worker_id, snapshot.worker_id)
                return
            self.indexer.apply_snapshot(snapshot)


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.decode().partition("-")
    return int(ms), int(seq or 0)


def _describe(err: Exception) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err)
