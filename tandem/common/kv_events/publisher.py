"""The worker side of the KV event stream: one worker's prefix-cache events into Redis.

Threading contract: ``on_engine_events`` is the engine's ``on_kv_events`` callback and
runs on the engine thread after a step. It numbers the batch and hands it to the event
loop (``call_soon_threadsafe``), so the engine never waits on Redis. A background task
writes whatever is pending in one pipeline of ``XADD``s per wake-up, trimming the
stream to about ``maxlen`` entries. While Redis is unreachable batches wait, up to
``max_pending``; older ones are then dropped, and readers see the gap in the numbers
and resync from a snapshot. When the worker has nothing to say for
``watermark_interval_s`` it writes a watermark (an empty batch repeating the last
number), so a reader that lost the tail of the stream notices within that interval.

``seq`` and ``snapshot`` are read on the engine thread too (inside ``AsyncEngine.call``),
which is what makes a snapshot and the batch numbers agree: every batch numbered up to
``snapshot.seq`` was produced before the snapshot was taken. Torch-free.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from tandem.common.hashing import BlockHash
from tandem.common.kv_events.events import KVCacheEvent
from tandem.common.kv_events.wire import (
    STREAM_FIELD,
    CacheSnapshot,
    EventBatch,
    encode_batch,
    kv_event_stream,
)
from tandem.common.registry import DEFAULT_PREFIX
from tandem.common.registry.redis_io import REDIS_ERRORS, FailureLog, connect

DEFAULT_MAXLEN = 100_000
"""Stream entries kept (about): enough for a router to ride out a pause of seconds."""
DEFAULT_MAX_PENDING = 10_000
DEFAULT_WATERMARK_INTERVAL_S = 1.0

_RETRY_S = 0.2

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineCaller(Protocol):
    """``engine.AsyncEngine`` as far as snapshots need it (this module is torch-free)."""

    async def call(self, fn: Callable[[Any], T]) -> T: ...


class KVEventPublisher:
    """Publishes one worker incarnation's prefix-cache events; see the module docstring.

    Lifecycle: ``start()`` on the event loop before the engine steps, ``aclose()`` at
    the end (it flushes what is pending, best effort). ``epoch`` names this incarnation
    (default: start-up time in ns, so a restarted worker with the same id is told apart).
    """

    def __init__(
        self,
        redis_url: str,
        model: str,
        worker_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        maxlen: int = DEFAULT_MAXLEN,
        max_pending: int = DEFAULT_MAX_PENDING,
        watermark_interval_s: float = DEFAULT_WATERMARK_INTERVAL_S,
        epoch: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.epoch = time.time_ns() if epoch is None else epoch
        self.stream = kv_event_stream(model, prefix)
        self._client = connect(redis_url)
        self._maxlen = maxlen
        self._watermark_interval_s = watermark_interval_s
        self._seq = 0  # engine thread only
        self._pending: collections.deque[EventBatch] = collections.deque(maxlen=max_pending)
        self._last_handed = 0  # event loop: newest seq handed over (written or pending)
        self._last_write = 0.0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_published = 0
        self.num_dropped = 0

    # --- the engine thread -------------------------------------------------------------

    @property
    def seq(self) -> int:
        """Number of the newest batch produced. Read it on the engine thread."""
        return self._seq

    def on_engine_events(self, events: Sequence[KVCacheEvent]) -> None:
        """The engine's ``on_kv_events`` callback: number the batch, hand it over."""
        self._seq += 1
        batch = EventBatch(self.worker_id, self.epoch, self._seq, tuple(events), time.time())
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._enqueue, batch)

    def snapshot(self, block_hashes: Sequence[BlockHash], block_size: int) -> CacheSnapshot:
        """The cache as of batch ``seq``; call on the engine thread with the pool's hashes."""
        return CacheSnapshot(self.worker_id, self.epoch, self._seq, tuple(block_hashes), block_size)

    async def snapshot_of(self, engine: EngineCaller) -> CacheSnapshot:
        """The engine's prefix cache, taken on the engine thread (so consistent with
        ``seq``): what a worker's ``ListCachedBlocks`` answers."""
        return await engine.call(
            lambda e: self.snapshot(e.block_pool.cached_hashes(), e.runtime.block_size)
        )

    # --- the event loop ----------------------------------------------------------------

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("publisher already started")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="kv-event-publisher")

    async def aclose(self) -> None:
        """Flush pending batches (one try), stop, close the connection."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pending:
            try:
                await self._write(list(self._pending))
            except REDIS_ERRORS as err:
                log.warning("dropping %d KV event batches at shutdown: %r", len(self._pending), err)
        await self._client.aclose()

    def _enqueue(self, batch: EventBatch) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.num_dropped += 1  # the deque drops the oldest; readers will resync
        self._pending.append(batch)
        self._last_handed = batch.seq
        self._wake.set()

    async def _run(self) -> None:
        failures = FailureLog(f"KV event stream {self.stream!r}")
        while True:
            await _wait_for_event(self._wake, self._watermark_interval_s)
            self._wake.clear()
            batches = list(self._pending) or self._watermark()
            if not batches:
                continue
            try:
                await self._write(batches)
                failures.succeeded()
            except REDIS_ERRORS as err:
                failures.failed(err)
                await asyncio.sleep(_RETRY_S)
                self._wake.set()
                continue
            written = batches[-1].seq
            while self._pending and self._pending[0].seq <= written:
                self._pending.popleft()

    def _watermark(self) -> list[EventBatch]:
        due = time.monotonic() - self._last_write >= self._watermark_interval_s
        if not due or self._last_handed == 0:
            return []
        return [EventBatch(self.worker_id, self.epoch, self._last_handed, (), time.time())]

    async def _write(self, batches: list[EventBatch]) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for batch in batches:
                pipe.xadd(
                    self.stream,
                    {STREAM_FIELD: encode_batch(batch)},
                    maxlen=self._maxlen,
                    approximate=True,
                )
            await pipe.execute()
        self._last_write = time.monotonic()
        self.num_published += sum(1 for b in batches if not b.is_watermark)


async def _wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until ``event`` is set or ``timeout_s`` passed (not ``wait_for``: on Python < 3.12
    it can swallow a cancellation that arrives as the event is set)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
