"""The prefill side of KV transfer: hosts the rendezvous store, builds pair groups on
handshake, and sends packed blocks when a decode worker pulls them.

Thread model. ``handshake`` and ``send_blocks`` run on worker threads (the gRPC servicer
calls them through ``asyncio.to_thread``), never on the engine thread. Each handshake
starts one background thread that joins the new group (the constructor blocks until the
decode worker joins). Sends to one decode worker are serialized; sends to different
ones run in parallel.

Reading the KV cache off the engine thread is safe because the blocks named in a send
belong to a lease (``leases.LeaseTable``), and the prefill worker never writes to,
frees or reuses a leased block until the lease is released or swept; the servicer pins
the lease for the whole send so neither can happen mid-read. On CUDA the pack runs on the
sending thread's current stream, so the engine must have finished writing those blocks
(it has: the lease is granted after the prefill step completed).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.common.faults import fault_at
from tandem.kvtransfer.blocks import checksum, pack_blocks
from tandem.kvtransfer.deadline import Deadline
from tandem.kvtransfer.errors import PairBroken, PairTimeout, UnknownPair
from tandem.kvtransfer.layout import KVLayout, check_compatible
from tandem.kvtransfer.pair import Backend, PairGroup, PairKey, Role, open_store
from tandem.protos import kv_transfer_pb2


@dataclass(frozen=True)
class PairOffer:
    """What a handshake tells the decode worker: where and how to join its pair group."""

    key: PairKey
    store_host: str
    store_port: int
    backend: Backend


class _PairSlot:
    """One generation of the pair with one decode worker.

    Owns the group (delivered by the join thread through ``_ready``) and a staging buffer
    for packed blocks, sized to the largest send so far and reused under ``send_lock``.
    """

    def __init__(self, key: PairKey, backend: Backend, wire_device: torch.device) -> None:
        self.key = key
        self.backend = backend
        self.wire_device = wire_device
        self.send_lock = threading.Lock()
        self._ready: concurrent.futures.Future[PairGroup] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._closed = False
        self._staging: torch.Tensor | None = None

    def joined(self, group: PairGroup) -> None:
        """Called by the join thread; a slot closed meanwhile closes the group at once."""
        with self._lock:
            if not self._closed:
                self._ready.set_result(group)
                return
        group.close()
        self._ready.set_exception(PairBroken(f"pair {self.key} was replaced while joining"))

    def join_failed(self, error: PairBroken) -> None:
        self._ready.set_exception(error)

    def group(self, timeout: float) -> PairGroup:
        """The joined group; waits up to ``timeout`` s for the join (``PairTimeout``)."""
        try:
            return self._ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise PairTimeout(f"pair {self.key} has not joined yet") from None

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of the staging buffer; call under ``send_lock``."""
        numel = math.prod(shape)
        if self._staging is None or self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=dtype, device=self.wire_device)
        return self._staging[:numel].view(shape)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            joined = self._ready.done() and self._ready.exception() is None
        if joined:
            self._ready.result().close()
        self._staging = None


@dataclass(frozen=True)
class SentBlocks:
    nbytes: int
    checksum: int
    """``blocks.checksum`` of the bytes, taken before they were sent."""


class KVSender:
    """Serves one engine's KV cache to decode workers.

    ``kv_caches`` is the engine's cache (one ``[2, num_blocks, block_size, heads, dim]``
    tensor per layer, the very tensors the engine keeps using); the sender only reads
    it, and only blocks it is told to send.
    ``store_port`` 0 picks a free port (see ``store_port`` after construction). The
    store listens on every interface; ``store_host`` is the address decode workers are
    told to use, and gloo connections are bound to it too, so it must be reachable from
    them. ``close`` closes every pair group.
    """

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor],
        store_host: str,
        store_port: int = 0,
        worker_id: str = "prefill",
        *,
        join_timeout: float = 30.0,
    ) -> None:
        _check_caches(layout, kv_caches)
        self.layout = layout
        self.worker_id = worker_id
        self.store_host = store_host
        self._kv_caches = list(kv_caches)
        self._device = kv_caches[0].device
        self._join_timeout = join_timeout
        self._store: dist.TCPStore | None = dist.TCPStore(
            store_host,
            store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=join_timeout),
        )
        self.store_port: int = self._store.port
        self._lock = threading.Lock()
        self.blocks_sent = 0
        """Blocks sent since start (all pairs)."""
        self._pairs: dict[str, _PairSlot] = {}
        self._generations: dict[str, int] = {}
        self._joins: list[threading.Thread] = []
        self._fault = fault_at("kv.send")

    def handshake(
        self, decode_worker_id: str, remote: kv_transfer_pb2.KVCompat, remote_device_type: str
    ) -> PairOffer:
        """Checks ``remote`` against this cache (``IncompatibleKV``), retires the decode
        worker's current pair generation, and starts joining a new one in the background.

        Returns without waiting for the join; the decode worker joins with the offer, and
        the join must finish within ``join_timeout`` seconds or the generation fails (its
        pulls get ``PairTimeout``/``PairBroken``). ``PairBroken`` when this sender's own
        store is unreachable.
        """
        if not decode_worker_id:
            raise ValueError("decode_worker_id is empty")
        check_compatible(self.layout, remote)
        backend = Backend.between(self._device.type, remote_device_type)
        # Connected here, not on the join thread: a connect still retrying when ``close``
        # stops the store would hold that thread for the whole join timeout.
        store = open_store("127.0.0.1", self.store_port, self._join_timeout)
        slot, previous = self._next_generation(f"{self.worker_id}->{decode_worker_id}", backend)
        if previous is not None:
            previous.close()
        join = threading.Thread(target=self._join, args=(slot, store), name=f"kv-join {slot.key}")
        with self._lock:
            self._joins = [*(t for t in self._joins if t.is_alive()), join]
        join.start()
        return PairOffer(slot.key, self.store_host, self.store_port, backend)

    def send_blocks(
        self, pair_id: str, generation: int, block_ids: Sequence[int], tag: int, timeout: float
    ) -> SentBlocks:
        """Packs ``block_ids`` and sends them to the pair's receiver under ``tag``; returns
        the bytes sent and their checksum once the send completed.

        Fault point ``kv.send`` (``tandem.common.faults``): ``corrupt`` damages the bytes
        after their checksum was taken, ``drop`` skips the send (the receiver times out).

        Raises ``UnknownPair`` (no such pair, or not its current generation),
        ``PairTimeout`` when the join, earlier sends to this pair, or this send outlast
        ``timeout`` seconds, ``PairBroken`` when the peer is lost. After a ``PairBroken``
        the pair is dropped; the decode worker must handshake again. Blocks; call off the
        event loop and off the engine thread.
        """
        deadline = Deadline.after(timeout)
        slot = self._current(pair_id, generation)
        group = slot.group(deadline.remaining())
        if not slot.send_lock.acquire(timeout=deadline.remaining()):
            raise PairTimeout(f"pair {slot.key}: earlier sends still running")
        try:
            packed = self._pack(slot, block_ids)
            sum_ = checksum(packed)
            fired = self._fault.action if self._fault is not None and self._fault.fire() else None
            if fired == "corrupt":
                packed.reshape(-1).view(torch.uint8)[0] ^= 0xFF
            if fired != "drop":
                group.send(packed, tag, deadline.remaining())
        except PairBroken:
            self._drop(slot)
            raise
        finally:
            slot.send_lock.release()
        with self._lock:
            self.blocks_sent += len(block_ids)
        return SentBlocks(packed.numel() * packed.element_size(), sum_)

    def close(self) -> None:
        """Closes every pair group (pending sends fail) and stops the rendezvous store,
        which fails any join still waiting for its decode worker; returns once the join
        threads have ended. Idempotent; ``handshake`` raises afterwards.

        Join threads are not daemons: one blocked inside gloo at interpreter exit aborts
        the process ("terminate called without an active exception").
        """
        with self._lock:
            slots, self._pairs = list(self._pairs.values()), {}
            joins, self._joins = self._joins, []
            self._store = None  # the last reference: the store's server stops
        for slot in slots:
            slot.close()
        for join in joins:
            join.join(self._join_timeout)

    def _next_generation(
        self, pair_id: str, backend: Backend
    ) -> tuple[_PairSlot, _PairSlot | None]:
        """Registers a new generation of the pair; returns it and the one it replaces."""
        with self._lock:
            if self._store is None:
                raise RuntimeError("KVSender is closed")
            generation = self._generations.get(pair_id, 0) + 1
            self._generations[pair_id] = generation
            key = PairKey(pair_id, generation)
            slot = _PairSlot(key, backend, backend.wire_device(self._device))
            previous = self._pairs.get(pair_id)
            self._pairs[pair_id] = slot
        return slot, previous

    def _join(self, slot: _PairSlot, store: dist.Store) -> None:
        """Runs on the slot's own thread over its own store connection (one TCPStore
        client blocked in a rendezvous stalls every other thread using it)."""
        try:
            group = PairGroup.connect(
                store,
                slot.key,
                Role.SENDER,
                slot.backend,
                slot.wire_device,
                self.store_host,
                self._join_timeout,
            )
        except PairBroken as error:
            slot.join_failed(error)
            self._drop(slot)
            return
        slot.joined(group)

    def _current(self, pair_id: str, generation: int) -> _PairSlot:
        with self._lock:
            slot = self._pairs.get(pair_id)
        if slot is None:
            raise UnknownPair(f"no pair {pair_id!r}: handshake first")
        if slot.key.generation != generation:
            raise UnknownPair(
                f"pair {pair_id!r} is at generation {slot.key.generation}, not {generation}"
            )
        return slot

    def _drop(self, slot: _PairSlot) -> None:
        with self._lock:
            if self._pairs.get(slot.key.pair_id) is slot:
                del self._pairs[slot.key.pair_id]
        slot.close()

    def _pack(self, slot: _PairSlot, block_ids: Sequence[int]) -> torch.Tensor:
        staging = slot.staging(self.layout.packed_shape(len(block_ids)), self.layout.storage_dtype)
        if slot.wire_device == self._device:
            return pack_blocks(self._kv_caches, block_ids, out=staging)
        return staging.copy_(pack_blocks(self._kv_caches, block_ids))


def _check_caches(layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> None:
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"{len(kv_caches)} cache tensors for {layout.num_layers} layers")
    for cache in kv_caches:
        num_blocks = cache.shape[1] if cache.dim() == 5 else 0
        if (
            tuple(cache.shape) != layout.cache_shape(num_blocks)
            or cache.dtype != layout.storage_dtype
        ):
            raise ValueError(
                f"cache tensor {tuple(cache.shape)} {cache.dtype} does not match {layout}"
            )
