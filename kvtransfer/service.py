"""The ``KVTransfer`` gRPC service of a prefill worker (``grpc.aio``).

Status codes: ``FAILED_PRECONDITION`` incompatible KV (message names every differing
field); ``NOT_FOUND`` unknown, released or expired lease, unknown pair or stale
generation; ``INVALID_ARGUMENT`` bad request (block index beyond the lease, no indices);
``DEADLINE_EXCEEDED`` the send did not finish within the RPC deadline; ``UNAVAILABLE``
the pair group broke (peer lost). ``RenewLease``/``ReleaseLease`` answer ``found=false``
for an unknown lease rather than an error, so a repeated release is harmless.

Blocking work (handshake, pack + send) runs in threads via ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence

import grpc

from tandem.kvtransfer.errors import IncompatibleKV, PairBroken, PairTimeout, UnknownPair
from tandem.kvtransfer.leases import EndedLease, LeaseTable
from tandem.kvtransfer.pair import FIRST_TAG, LAST_TAG
from tandem.kvtransfer.ranks import RankedOffer, RankedSender, RankedSent
from tandem.kvtransfer.sender import KVSender, PairOffer, SentBlocks
from tandem.protos import kv_transfer_pb2, kv_transfer_pb2_grpc


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """Wires a ``KVSender`` and the prefill worker's ``LeaseTable`` to the wire.

    ``on_release(lease)`` receives each lease a decode worker released (from
    ``ReleaseLease``, or after the last pull of a lease released mid-pull), exactly once;
    the prefill worker must free its blocks. It is called on the server's event loop, so
    it must not block (hand the work to the engine thread). Leases that expire are not
    seen here: the prefill worker sweeps ``LeaseTable.expired`` itself.

    ``max_send_s`` caps how long a send may wait; a shorter RPC deadline wins.
    ``on_sent(blocks, nbytes, seconds)`` is told of each send that finished.
    A tensor-parallel prefill worker passes a ``RankedSender``: offers and checksums
    then cover every rank (``kvtransfer.ranks``).
    """

    def __init__(
        self,
        sender: KVSender | RankedSender,
        leases: LeaseTable,
        on_release: Callable[[EndedLease], None],
        *,
        max_send_s: float = 60.0,
        on_sent: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self._on_sent = on_sent
        self._sender = sender
        self._leases = leases
        self._on_release = on_release
        self._max_send_s = max_send_s

    async def Handshake(
        self, request: kv_transfer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.HandshakeResponse:
        try:
            offer = await asyncio.to_thread(
                self._sender.handshake,
                request.decode_worker_id,
                request.compat,
                request.device_type,
            )
        except IncompatibleKV as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except PairBroken as error:  # its own rendezvous store is unreachable
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        rank_offers = []
        if isinstance(offer, RankedOffer):
            offer, rank_offers = offer.offer, [_rank_offer(o) for o in offer.ranks]
        return kv_transfer_pb2.HandshakeResponse(
            pair_id=offer.key.pair_id,
            generation=offer.key.generation,
            store_host=offer.store_host,
            store_port=offer.store_port,
            backend=offer.backend.value,
            rank_offers=rank_offers,
        )

    async def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.PullBlocksResponse:
        lease_id = request.lease_id
        lease_blocks = self._leases.pin(lease_id)
        if lease_blocks is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"lease {lease_id!r} is unknown, released or expired"
            )
        try:
            block_ids = _select(lease_id, lease_blocks, request.block_indices)
            if not FIRST_TAG <= request.tag <= LAST_TAG:
                raise ValueError(f"tag {request.tag} outside [{FIRST_TAG}, {LAST_TAG}]")
        except ValueError as error:
            self._unpin(lease_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        send = functools.partial(
            self._sender.send_blocks,
            request.pair_id,
            request.generation,
            block_ids,
            request.tag,
            self._send_timeout(context),
        )
        sending = asyncio.to_thread(self._send_pinned, lease_id, send, asyncio.get_running_loop())
        start = time.monotonic()
        try:  # shielded: a cancelled RPC must not stop the thread before it unpins
            sent = await asyncio.shield(sending)
        except (UnknownPair, PairBroken) as error:
            await context.abort(_status_of(error), str(error))
        rank_checksums: tuple[int, ...] = ()
        if isinstance(sent, RankedSent):
            sent, rank_checksums = sent.sent, sent.rank_checksums
        if self._on_sent is not None:
            nbytes = sent.nbytes * (1 + len(rank_checksums))
            self._on_sent(len(block_ids), nbytes, time.monotonic() - start)
        return kv_transfer_pb2.PullBlocksResponse(
            bytes_sent=sent.nbytes, checksum=sent.checksum, rank_checksums=rank_checksums
        )

    async def RenewLease(
        self, request: kv_transfer_pb2.LeaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.LeaseResponse:
        renewed = self._leases.renew(request.lease_id)
        time_left = self._leases.time_left(request.lease_id) if renewed else None
        if time_left is None:
            return kv_transfer_pb2.LeaseResponse(found=False)
        return kv_transfer_pb2.LeaseResponse(found=True, ttl_s=time_left)

    async def ReleaseLease(
        self, request: kv_transfer_pb2.LeaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.LeaseResponse:
        release = self._leases.release(request.lease_id)
        if release.ended is not None:
            self._on_release(release.ended)
        return kv_transfer_pb2.LeaseResponse(found=release.found)

    def _unpin(self, lease_id: str) -> None:
        ended = self._leases.unpin(lease_id)
        if ended is not None:
            self._on_release(ended)

    def _send_pinned(
        self, lease_id: str, send: Callable[[], SentBlocks], loop: asyncio.AbstractEventLoop
    ) -> SentBlocks:
        """Runs ``send`` and then unpins the lease, both in the sending thread, so the pin
        outlives the read even when the RPC is cancelled while the thread still runs."""
        try:
            return send()
        finally:
            ended = self._leases.unpin(lease_id)
            if ended is not None:
                loop.call_soon_threadsafe(self._on_release, ended)

    def _send_timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self._max_send_s if remaining is None else min(remaining, self._max_send_s)


def _select(lease_id: str, lease_blocks: list[int], indices: Sequence[int]) -> list[int]:
    """The lease's block ids at ``indices``; ``ValueError`` names the first bad index."""
    if not indices:
        raise ValueError("no block indices given")
    for index in indices:
        if index >= len(lease_blocks):
            raise ValueError(
                f"block index {index} out of range for lease {lease_id!r} "
                f"with {len(lease_blocks)} blocks"
            )
    return [lease_blocks[index] for index in indices]


def _rank_offer(offer: PairOffer) -> kv_transfer_pb2.RankOffer:
    return kv_transfer_pb2.RankOffer(
        pair_id=offer.key.pair_id,
        generation=offer.key.generation,
        store_host=offer.store_host,
        store_port=offer.store_port,
        backend=offer.backend.value,
    )


def _status_of(error: UnknownPair | PairBroken) -> grpc.StatusCode:
    if isinstance(error, UnknownPair):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, PairTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNAVAILABLE
