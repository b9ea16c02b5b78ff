"""KV a worker holds for another worker to pull: the lease side of a hand-off.

A prefill worker holds each prompt's KV after its first token; a decode worker holds a
running sequence's KV when it hands the sequence to a peer (a migration). Both do the
same: the engine keeps the blocks (``PREFILLED``), ``grant`` leases them and returns
the ``KVHandle`` the puller needs, and when the lease ends — released by the puller,
aborted, or expired unpulled (``sweep``) — the blocks go back to the engine's prefix
cache, exactly once (``LeaseTable`` guarantees it, pins included).

Runs on the server's event loop; the engine is only reached through ``AsyncEngine.call``.
``serve_held_kv`` builds the whole sending side a worker serves: the KV sender, its
leases and the ``KVTransfer`` servicer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.common.metrics import Sample
from tandem.common.worker_host import WorkerOptions
from tandem.common.worker_metrics import WorkerMetrics
from tandem.engine.async_engine import AsyncEngine
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.leases import EndedLease, LeaseTable
from tandem.kvtransfer.ranks import RankedSender
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.service import KVTransferServicer
from tandem.protos import worker_pb2

log = logging.getLogger(__name__)

LEASE_SWEEP_INTERVAL_S = 0.5


class HeldKV:
    def __init__(
        self,
        engine: AsyncEngine,
        leases: LeaseTable,
        worker_id: str,
        lease_ttl_s: float,
        on_expired: Callable[[EndedLease], None] | None = None,
    ) -> None:
        """``on_expired`` is told of each lease nobody pulled in time (a metric)."""
        self.engine = engine
        self.leases = leases
        self.worker_id = worker_id
        self.lease_ttl_s = lease_ttl_s
        self.kv_endpoint = ""
        """This worker's own address (set once the server is bound)."""
        self._on_expired = on_expired
        self._lease_of: dict[str, str] = {}
        self._background: set[asyncio.Future[object]] = set()

    def grant(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int
    ) -> worker_pb2.KVHandle:
        """Lease ``block_ids`` (the engine holds them for ``request_id``), which hold the
        KV of the request's first ``num_tokens`` tokens."""
        lease_id = self.leases.grant(request_id, block_ids, self.lease_ttl_s)
        self._lease_of[request_id] = lease_id
        return worker_pb2.KVHandle(
            prefill_worker_id=self.worker_id,
            kv_endpoint=self.kv_endpoint,
            lease_id=lease_id,
            num_tokens=num_tokens,
            num_blocks=len(block_ids),
            lease_ttl_s=self.lease_ttl_s,
        )

    def holds(self, request_id: str) -> bool:
        return request_id in self._lease_of

    def abort(self, request_id: str) -> bool:
        """End ``request_id``'s lease now (a pull in progress finishes first); ``False``
        when it has none."""
        lease_id = self._lease_of.get(request_id)
        if lease_id is None:
            return False
        release = self.leases.release(lease_id)
        if release.ended is not None:
            self.ended(release.ended)
        return release.found

    def ended(self, lease: EndedLease) -> None:
        """Hand a lease's blocks back to the engine (on the event loop; never blocks)."""
        self._lease_of.pop(lease.request_id, None)
        rid = lease.request_id
        task = asyncio.ensure_future(self.engine.call(lambda e: e.release_prefilled(rid)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def sweep(self) -> None:
        """Background task: free the KV of leases nobody pulled in time."""
        while True:
            await asyncio.sleep(LEASE_SWEEP_INTERVAL_S)
            for lease in self.leases.expired():
                log.warning("lease of %s expired unpulled", lease.request_id)
                if self._on_expired is not None:
                    self._on_expired(lease)
                self.ended(lease)

    def __len__(self) -> int:
        return len(self.leases)


@dataclass(frozen=True)
class KVSendingSide:
    """What a worker serves so that others can pull the KV it holds."""

    sender: KVSender | RankedSender
    held: HeldKV
    servicer: KVTransferServicer


def serve_held_kv(
    async_engine: AsyncEngine, layout: KVLayout, options: WorkerOptions, metrics: WorkerMetrics
) -> KVSendingSide:
    """The sending side of a worker whose engine is ``async_engine``: a KV sender over
    its cache (rank i of a tensor-parallel replica sends to rank i of the puller's), the
    leases, and the servicer, with their metrics (sends, leases held and expired)."""
    engine = async_engine.engine
    sender: KVSender | RankedSender = KVSender(
        layout,
        engine.runner.kv_caches,
        options.public_host,
        options.kv_store_port,
        options.worker_id,
    )
    if engine.rank_control is not None:
        sender = RankedSender(sender, engine.rank_control)
    leases = LeaseTable()
    metrics.report(
        lambda: iter([Sample("kv_leases_active", "gauge", "KV held for a pull", len(leases))])
    )
    held = HeldKV(
        async_engine,
        leases,
        options.worker_id,
        options.lease_ttl_s,
        on_expired=lambda lease: metrics.leases_expired.inc(),
    )

    def sent(blocks: int, nbytes: int, seconds: float) -> None:
        metrics.kv_sent_blocks.inc(blocks)
        metrics.kv_sent_bytes.inc(nbytes)
        metrics.kv_send_seconds.observe(seconds)

    servicer = KVTransferServicer(sender, leases, held.ended, on_sent=sent)
    return KVSendingSide(sender, held, servicer)
