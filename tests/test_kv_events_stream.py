"""KV events through a real Redis stream: the worker-side publisher, the router-side
consumer, resyncs from snapshots (on join, on a gap, after a router restart), purges,
and two router replicas building the same index."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis

from tandem.common.hashing import hash_blocks
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, KVCacheEvent
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.kv_events.wire import (
    STREAM_FIELD,
    CacheSnapshot,
    EventBatch,
    decode_batch,
    encode_batch,
    kv_event_stream,
)
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.router.kv_index.consumer import KVEventConsumer
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
PROMPT = hash_blocks(list(range(320)), 16)  # 20 blocks


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def record(worker_id: str) -> WorkerRecord:
    capacity = WorkerCapacity(num_kv_blocks=64, block_size=16, max_num_seqs=8)
    info = WorkerInfo(worker_id, WorkerRole.PREFILL, "127.0.0.1:1", MODEL, capacity)
    return WorkerRecord(info, WorkerLoad.idle(capacity))


class FakeWorker:
    """A worker's prefix cache that writes its own batches (so a test can lose some)."""

    def __init__(self, redis_url: str, prefix: str, worker_id: str, epoch: int = 1) -> None:
        self.worker_id, self.epoch = worker_id, epoch
        self.cache: set[bytes] = set()
        self.seq = 0
        self.snapshots_served = 0
        self._stream = kv_event_stream(MODEL, prefix)
        self._client = redis.Redis.from_url(redis_url)

    def step(self, *events: KVCacheEvent, lose: bool = False) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                self.cache |= set(event.block_hashes)
            elif isinstance(event, BlocksEvicted):
                self.cache -= set(event.block_hashes)
        self.seq += 1
        if not lose:
            batch = EventBatch(self.worker_id, self.epoch, self.seq, events, time.time())
            self._client.xadd(self._stream, {STREAM_FIELD: encode_batch(batch)})

    def watermark(self) -> None:
        batch = EventBatch(self.worker_id, self.epoch, self.seq, (), time.time())
        self._client.xadd(self._stream, {STREAM_FIELD: encode_batch(batch)})

    async def snapshot(self, worker: WorkerRecord) -> CacheSnapshot:
        assert worker.info.worker_id == self.worker_id
        self.snapshots_served += 1
        return CacheSnapshot(self.worker_id, self.epoch, self.seq, tuple(self.cache), 16)


def consumer_for(redis_url: str, prefix: str, workers: dict[str, FakeWorker]) -> KVEventConsumer:
    async def fetch(worker: WorkerRecord) -> CacheSnapshot:
        return await workers[worker.info.worker_id].snapshot(worker)

    return KVEventConsumer(redis_url, MODEL, KVIndexer(), fetch, RouterMetrics(), prefix=prefix)


def stored(hashes) -> BlocksStored:
    return BlocksStored(tuple(hashes), None)


def test_events_reach_the_index_and_a_joining_worker_is_snapshotted(redis_url, prefix) -> None:
    async def main() -> None:
        a = FakeWorker(redis_url, prefix, "a")
        a.step(stored(PROMPT[:5]))  # before the router starts: only a snapshot can tell
        consumer = consumer_for(redis_url, prefix, {"a": a})
        await consumer.start()
        consumer.worker_joined(record("a"))
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"a": 5})
        a.step(stored(PROMPT[5:12]))
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"a": 12})
        assert a.snapshots_served == 1
        assert consumer.metrics.value("router_kv_event_lag_seconds_count") >= 1
        await consumer.stop()

    run(main())


def test_a_gap_in_the_stream_triggers_a_resync(redis_url, prefix) -> None:
    async def main() -> None:
        a = FakeWorker(redis_url, prefix, "a")
        consumer = consumer_for(redis_url, prefix, {"a": a})
        await consumer.start()
        consumer.worker_joined(record("a"))
        await eventually(lambda: not consumer.indexer.is_syncing("a"))
        a.step(stored(PROMPT[:4]))
        a.step(stored(PROMPT[4:8]), lose=True)  # trimmed away, or never written
        a.step(stored(PROMPT[8:10]))
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"a": 10})
        assert consumer.indexer.stats.gaps == 1 and a.snapshots_served == 2
        # A loss at the tail shows up at the next watermark.
        a.step(BlocksEvicted(tuple(PROMPT[6:])), lose=True)
        a.watermark()
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"a": 6})
        await consumer.stop()

    run(main())


def test_a_restarted_router_rebuilds_its_index_and_replicas_agree(redis_url, prefix) -> None:
    async def main() -> None:
        workers = {w: FakeWorker(redis_url, prefix, w) for w in ("a", "b")}
        first = consumer_for(redis_url, prefix, workers)
        await first.start()
        for w in workers:
            first.worker_joined(record(w))
        workers["a"].step(stored(PROMPT[:9]))
        workers["b"].step(stored(PROMPT[:3]))
        await eventually(lambda: dict(first.indexer.overlap(PROMPT)) == {"a": 9, "b": 3})
        await first.stop()  # the router goes away; the workers carry on
        workers["b"].step(stored(PROMPT[3:15]))
        restarted = consumer_for(redis_url, prefix, workers)
        replica = consumer_for(redis_url, prefix, workers)
        for consumer in (restarted, replica):
            await consumer.start()
            for w in workers:
                consumer.worker_joined(record(w))
        workers["a"].step(BlocksEvicted(tuple(PROMPT[5:9])))
        expected = {"a": 5, "b": 15}
        for consumer in (restarted, replica):
            await eventually(lambda c=consumer: dict(c.indexer.overlap(PROMPT)) == expected)
        await restarted.stop()
        await replica.stop()

    run(main())


def test_a_worker_that_leaves_is_purged_and_its_late_events_ignored(redis_url, prefix) -> None:
    async def main() -> None:
        workers = {w: FakeWorker(redis_url, prefix, w) for w in ("a", "b")}
        consumer = consumer_for(redis_url, prefix, workers)
        await consumer.start()
        for w in workers:
            consumer.worker_joined(record(w))
        workers["a"].step(stored(PROMPT))
        workers["b"].step(stored(PROMPT[:2]))
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"a": 20, "b": 2})
        consumer.worker_left(record("a"))
        assert dict(consumer.indexer.overlap(PROMPT)) == {"b": 2}
        assert consumer.indexer.index.num_blocks("a") == 0
        workers["a"].step(stored(PROMPT))
        workers["b"].step(stored(PROMPT[2:4]))
        await eventually(lambda: dict(consumer.indexer.overlap(PROMPT)) == {"b": 4})
        assert "a" not in consumer.indexer.index.workers()
        await consumer.stop()

    run(main())


def test_the_publisher_numbers_batches_and_never_blocks_the_engine_thread(
    redis_url, prefix
) -> None:
    async def main() -> None:
        publisher = KVEventPublisher(redis_url, MODEL, "w", prefix=prefix, watermark_interval_s=0.2)
        publisher.start()
        engine_thread_seqs: list[int] = []

        def engine_thread() -> None:  # what LLMEngine does after each step
            for i in range(20):
                publisher.on_engine_events([stored(PROMPT[i : i + 1])])
                engine_thread_seqs.append(publisher.seq)

        client = redis.Redis.from_url(redis_url)
        stream = kv_event_stream(MODEL, prefix)
        # The event loop is held (a blocking join, no await) while the engine thread
        # publishes, so nothing can reach Redis meanwhile: all 20 calls must return anyway.
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join(timeout=10)  # only a blocking publisher runs into this
        assert not thread.is_alive(), "on_engine_events waited for the event loop"
        assert client.xlen(stream) == 0  # ... and none of them wrote to Redis itself

        def batches() -> list[EventBatch]:
            return [decode_batch(f[STREAM_FIELD]) for _, f in client.xrange(stream)]

        await eventually(lambda: len([b for b in batches() if not b.is_watermark]) == 20)
        data = [b for b in batches() if not b.is_watermark]
        assert [b.seq for b in data] == list(range(1, 21)) == engine_thread_seqs
        assert {b.epoch for b in data} == {publisher.epoch}
        await eventually(lambda: batches()[-1].is_watermark)  # idle: a watermark follows
        assert batches()[-1].seq == 20
        snapshot = publisher.snapshot(PROMPT[:20], 16)
        assert snapshot.seq == 20 and snapshot.epoch == publisher.epoch
        await publisher.aclose()
        client.close()

    run(main())
