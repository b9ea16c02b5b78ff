"""Prefix-cache events on the wire: the Redis stream they travel on and their codec.

Workers publish ``EventBatch``es (``tandem.common.kv_events.publisher``); routers read them
into their KV index (``tandem.router.kv_index.consumer``). One stream per model:

    P M:kv-events   Redis stream, trimmed to about ``maxlen`` entries by each writer.
                    One entry per batch, one field: ``b`` = a serialized
                    ``tandem.v1.KVEventBatch`` (``protos/worker.proto``).

A worker numbers its batches 1, 2, 3, ... within one incarnation (``epoch``), so a
reader that sees a number skipped knows it lost events and resyncs from a
``CacheSnapshot`` (the worker's ``ListCachedBlocks`` RPC). A batch with no events
repeats the last number: a watermark that lets a reader notice lost events even when
the worker has nothing new to say.

Torch-free; nothing here touches Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from tandem.common.hashing import BlockHash
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, CacheCleared, KVCacheEvent
from tandem.common.registry import DEFAULT_PREFIX
from tandem.protos import worker_pb2

WIRE_VERSION = 1
"""``KVEventBatch.version`` this build writes and reads."""

HASH_BYTES = 16
STREAM_FIELD = b"b"
"""The one field of a stream entry: the serialized batch."""


def kv_event_stream(model: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The Redis stream carrying ``model``'s prefix-cache events."""
    return f"{prefix}{model}:kv-events"


class KVEventDecodeError(ValueError):
    """Bytes that are not a batch this build understands (corrupt, or a newer version)."""


@dataclass(frozen=True)
class EventBatch:
    """A worker's prefix-cache events of one engine step, numbered ``seq`` within ``epoch``.

    No events: a watermark saying "my last batch was ``seq``". ``published_at`` is the
    worker's wall clock (seconds since the epoch), for measuring event lag.
    """

    worker_id: str
    epoch: int
    seq: int
    events: tuple[KVCacheEvent, ...]
    published_at: float = 0.0

    @property
    def is_watermark(self) -> bool:
        return not self.events


@dataclass(frozen=True)
class CacheSnapshot:
    """Every block in a worker's prefix cache, as of batch ``seq`` of ``epoch``.

    The snapshot reflects every batch up to ``seq`` and possibly some later ones; a
    reader replays batches after ``seq`` on top of it (each event sets a block's state,
    so replaying one already reflected changes nothing).
    """

    worker_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...]
    block_size: int


def encode_batch(batch: EventBatch) -> bytes:
    message = worker_pb2.KVEventBatch(
        version=WIRE_VERSION,
        worker_id=batch.worker_id,
        epoch=batch.epoch,
        seq=batch.seq,
        published_at=batch.published_at,
    )
    for event in batch.events:
        _event_to_proto(event, message.events.add())
    return message.SerializeToString()


def decode_batch(raw: bytes) -> EventBatch:
    """The batch ``encode_batch`` wrote; ``KVEventDecodeError`` for anything else."""
    message = worker_pb2.KVEventBatch()
    try:
        message.ParseFromString(raw)
    except DecodeError as err:
        raise KVEventDecodeError(f"not a KVEventBatch: {err}") from err
    if message.version != WIRE_VERSION:
        raise KVEventDecodeError(
            f"KVEventBatch version {message.version}; this build reads {WIRE_VERSION}"
        )
    if not message.worker_id or message.seq < 1:
        raise KVEventDecodeError("KVEventBatch without worker_id or seq")
    events = tuple(_event_from_proto(e) for e in message.events)
    return EventBatch(message.worker_id, message.epoch, message.seq, events, message.published_at)


def snapshot_to_proto(snapshot: CacheSnapshot) -> worker_pb2.CachedBlocks:
    return worker_pb2.CachedBlocks(
        worker_id=snapshot.worker_id,
        epoch=snapshot.epoch,
        seq=snapshot.seq,
        block_hashes=b"".join(snapshot.block_hashes),
        block_size=snapshot.block_size,
    )


def snapshot_from_proto(message: worker_pb2.CachedBlocks) -> CacheSnapshot:
    return CacheSnapshot(
        message.worker_id,
        message.epoch,
        message.seq,
        split_hashes(message.block_hashes),
        message.block_size,
    )


def split_hashes(raw: bytes) -> tuple[BlockHash, ...]:
    """``16 * n`` concatenated bytes as ``n`` hashes."""
    if len(raw) % HASH_BYTES:
        raise KVEventDecodeError(f"{len(raw)} hash bytes is not a multiple of {HASH_BYTES}")
    return tuple(BlockHash(raw[i : i + HASH_BYTES]) for i in range(0, len(raw), HASH_BYTES))


def _event_to_proto(event: KVCacheEvent, out: worker_pb2.KVCacheEvent) -> None:
    match event:
        case BlocksStored(block_hashes=hashes, parent=parent):
            out.stored.block_hashes = b"".join(hashes)
            out.stored.parent = parent or b""
        case BlocksEvicted(block_hashes=hashes):
            out.evicted.block_hashes = b"".join(hashes)
        case CacheCleared():
            out.cleared.SetInParent()
        case _:
            raise TypeError(f"not a KV cache event: {event!r}")


def _event_from_proto(message: worker_pb2.KVCacheEvent) -> KVCacheEvent:
    kind = message.WhichOneof("kind")
    if kind == "stored":
        parent = message.stored.parent
        if parent and len(parent) != HASH_BYTES:
            raise KVEventDecodeError(f"parent hash of {len(parent)} bytes")
        return BlocksStored(
            split_hashes(message.stored.block_hashes), BlockHash(parent) if parent else None
        )
    if kind == "evicted":
        return BlocksEvicted(split_hashes(message.evicted.block_hashes))
    if kind == "cleared":
        return CacheCleared()
    raise KVEventDecodeError("KVCacheEvent with no kind (written by a newer build?)")
