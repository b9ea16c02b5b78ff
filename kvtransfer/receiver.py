"""The decode side of KV transfer: pulls a lease's blocks from prefill workers.

One ``PairGroup`` per prefill endpoint, made lazily by the ``Handshake`` RPC and cached
until anything fails; then it is torn down and the next pull handshakes a new
generation. Pulls from one endpoint run one at a time (NCCL matches transfers by order,
and the sender serializes them anyway); pulls from different endpoints overlap.

A pull posts its receive first, then asks the sender to send (``PullBlocks``, with the
pull's remaining time as the RPC deadline), then waits for the data with what time is
left. Every wait is bounded by the pull's ``timeout`` — handshake and join included — so
a dead or stuck sender costs at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import grpc
import torch

from tandem.common.tls import InternalTLS, internal_channel
from tandem.engine.parallel.group import RankLost
from tandem.kvtransfer.blocks import checksum
from tandem.kvtransfer.deadline import Deadline
from tandem.kvtransfer.errors import (
    KVPullFailed,
    LeaseCallFailed,
    PairBroken,
    PairTimeout,
    PullFailure,
)
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.pair import (
    FIRST_TAG,
    Backend,
    PairGroup,
    PairKey,
    PendingRecv,
    Role,
    local_address_towards,
    next_tag,
    open_store,
)
from tandem.kvtransfer.ranks import ReceiverRanks
from tandem.kvtransfer.sender import PairOffer
from tandem.protos import kv_transfer_pb2, kv_transfer_pb2_grpc

_FAILURE_OF_STATUS = MappingProxyType(
    {
        grpc.StatusCode.FAILED_PRECONDITION: PullFailure.INCOMPATIBLE,
        grpc.StatusCode.NOT_FOUND: PullFailure.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT: PullFailure.BAD_REQUEST,
        grpc.StatusCode.DEADLINE_EXCEEDED: PullFailure.TIMEOUT,
        grpc.StatusCode.UNAVAILABLE: PullFailure.PEER_LOST,
    }
)


@dataclass(frozen=True)
class PullStats:
    """Counters since the receiver was made. ``bytes`` counts payload received."""

    pulls: int = 0
    blocks: int = 0
    bytes: int = 0
    handshakes: int = 0
    failures: Mapping[PullFailure, int] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def with_pull(self, blocks: int, nbytes: int) -> PullStats:
        return replace(
            self, pulls=self.pulls + 1, blocks=self.blocks + blocks, bytes=self.bytes + nbytes
        )

    def with_failure(self, reason: PullFailure) -> PullStats:
        return replace(self, failures={**self.failures, reason: self.failures.get(reason, 0) + 1})


@dataclass(frozen=True)
class _PullRequest:
    lease_id: str
    indices: tuple[int, ...]
    deadline: Deadline
    out: torch.Tensor | None


class _ProtocolViolation(Exception):
    """The sender answered something this receiver cannot use."""


class _Corrupt(Exception):
    """The bytes received are not the bytes sent."""


class _Link:
    """One connected generation of the pair with one prefill worker."""

    def __init__(self, group: PairGroup) -> None:
        self.group = group
        self._next_tag = FIRST_TAG

    def take_tag(self) -> int:
        tag, self._next_tag = self._next_tag, next_tag(self._next_tag)
        return tag


class _Peer:
    """A prefill endpoint: its gRPC channel, and the pair group when connected."""

    def __init__(self, endpoint: str, tls: InternalTLS | None) -> None:
        self.endpoint = endpoint
        self.tls = tls
        self.channel = internal_channel(endpoint, tls)
        self.stub = kv_transfer_pb2_grpc.KVTransferStub(self.channel)
        self.lock = asyncio.Lock()
        self.link: _Link | None = None

    def fresh_channel(self) -> grpc.aio.Channel:
        """Swaps in a new channel and returns the old one for the caller to close.

        After a lost peer, gRPC keeps the old channel in reconnect backoff (growing up
        to minutes), failing calls at once even when a restarted peer is listening.
        """
        old = self.channel
        self.channel = internal_channel(self.endpoint, self.tls)
        self.stub = kv_transfer_pb2_grpc.KVTransferStub(self.channel)
        return old


class KVReceiver:
    """Pulls KV blocks for one decode worker (``worker_id``) onto ``device``.

    Use from one event loop (the gRPC channels belong to it); ``close`` when done.
    ``tls``: mutual TLS on the control channel to prefill workers (``None``: plaintext).
    """

    def __init__(
        self,
        layout: KVLayout,
        worker_id: str,
        device: torch.device | str,
        tls: InternalTLS | None = None,
        ranks: ReceiverRanks | None = None,
    ) -> None:
        """``ranks``: the other ranks of a tensor-parallel decode replica; each pull then
        also lands their heads' blocks there, staged until ``ranks`` writes them."""
        self.ranks = ranks
        self.layout = layout
        self.tls = tls
        self.worker_id = worker_id
        self.device = _indexed(torch.device(device))
        self._peers: dict[str, _Peer] = {}
        self._stats = PullStats()

    @property
    def stats(self) -> PullStats:
        return self._stats

    async def pull(
        self,
        endpoint: str,
        lease_id: str,
        block_indices: Sequence[int],
        timeout: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fetches blocks ``block_indices`` (indices into the lease's blocks) of lease
        ``lease_id`` from the prefill worker at ``endpoint`` (``host:port``).

        Returns the blocks packed, ``layout.packed_shape(len(block_indices))`` on
        ``device``, for the caller to unpack into its own blocks
        (``blocks.unpack_blocks``): in ``out`` when given (contiguous, that shape and
        dtype, on ``device``; reusing one saves allocating and faulting in a buffer per
        pull), else in a new tensor. The caller owns the result. The lease stays held:
        ``release`` it afterwards. Raises ``KVPullFailed`` within ``timeout`` seconds on
        any failure (``out`` then holds garbage; the pair with that endpoint is gone and
        the next pull handshakes again).
        """
        packed, _ = await self.pull_ranked(endpoint, lease_id, block_indices, timeout, out)
        return packed

    async def pull_ranked(
        self,
        endpoint: str,
        lease_id: str,
        block_indices: Sequence[int],
        timeout: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """``pull``, plus the id under which the other ranks staged their share (``None``
        without ranks): write it with ``ModelRunner.unpack_on_ranks`` or drop it with
        ``ReceiverRanks.discard``."""
        if not block_indices:
            raise ValueError("no block indices to pull")
        if out is not None:
            self._check_out(out, len(block_indices))
        request = _PullRequest(lease_id, tuple(block_indices), Deadline.after(timeout), out)
        peer = self._peer(endpoint)
        try:
            packed, pull_id = await self._pull_serialized(peer, request)
        except KVPullFailed as failure:
            self._stats = self._stats.with_failure(failure.reason)
            raise
        ranks = 1 if self.ranks is None else self.ranks.size
        self._stats = self._stats.with_pull(len(block_indices), packed.nbytes * ranks)
        return packed, pull_id

    async def renew(self, endpoint: str, lease_id: str, timeout: float = 5.0) -> float | None:
        """Extends the lease by its TTL; returns the seconds left, or ``None`` when the
        prefill worker no longer has it. ``LeaseCallFailed`` when the call fails."""
        stub = self._peer(endpoint).stub
        reply = await _lease_call(stub.RenewLease, endpoint, lease_id, timeout)
        return reply.ttl_s if reply.found else None

    async def release(self, endpoint: str, lease_id: str, timeout: float = 5.0) -> bool:
        """Ends the lease (its blocks become prefix cache there); ``False`` when it was
        already gone. ``LeaseCallFailed`` when the call fails (it will expire anyway)."""
        stub = self._peer(endpoint).stub
        reply = await _lease_call(stub.ReleaseLease, endpoint, lease_id, timeout)
        return reply.found

    async def close(self) -> None:
        """Closes every pair group and channel. The receiver is unusable afterwards."""
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            link, peer.link = peer.link, None
            if link is not None:
                await asyncio.to_thread(link.group.close)
            await peer.channel.close()

    def _check_out(self, out: torch.Tensor, num_blocks: int) -> None:
        shape = self.layout.packed_shape(num_blocks)
        if tuple(out.shape) != shape or out.dtype != self.layout.storage_dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {shape}")
        if out.device != self.device or not out.is_contiguous():
            raise ValueError(f"out must be contiguous on {self.device}")

    def _peer(self, endpoint: str) -> _Peer:
        if endpoint not in self._peers:
            self._peers[endpoint] = _Peer(endpoint, self.tls)
        return self._peers[endpoint]

    async def _pull_serialized(
        self, peer: _Peer, pull: _PullRequest
    ) -> tuple[torch.Tensor, int | None]:
        try:
            await asyncio.wait_for(peer.lock.acquire(), pull.deadline.remaining())
        except TimeoutError:
            detail = "earlier pulls from this prefill worker did not finish in time"
            raise KVPullFailed(PullFailure.TIMEOUT, peer.endpoint, pull.lease_id, detail) from None
        try:
            return await self._pull_locked(peer, pull)
        except KVPullFailed as failure:
            self._discard(peer)
            if failure.reason is PullFailure.PEER_LOST:
                await peer.fresh_channel().close()
            raise
        except BaseException:  # cancellation included: the pair's state is unknown
            self._discard(peer)
            raise
        finally:
            peer.lock.release()

    async def _pull_locked(
        self, peer: _Peer, pull: _PullRequest
    ) -> tuple[torch.Tensor, int | None]:
        """Does the pull; every failure comes out as ``KVPullFailed``."""
        try:
            if peer.link is None:
                peer.link = await self._connect(peer, pull.deadline)
            return await self._transfer(peer, peer.link, pull)
        except grpc.aio.AioRpcError as error:
            reason = _FAILURE_OF_STATUS.get(error.code(), PullFailure.RPC_ERROR)
            detail = f"{error.code().name}: {error.details()}"
        except PairTimeout as error:
            reason, detail = PullFailure.TIMEOUT, str(error)
        except PairBroken as error:
            reason, detail = PullFailure.PEER_LOST, str(error)
        except _ProtocolViolation as error:
            reason, detail = PullFailure.RPC_ERROR, str(error)
        except _Corrupt as error:
            reason, detail = PullFailure.CORRUPT, str(error)
        except RankLost as error:
            reason, detail = PullFailure.PEER_LOST, str(error)
        raise KVPullFailed(reason, peer.endpoint, pull.lease_id, detail)

    async def _connect(self, peer: _Peer, deadline: Deadline) -> _Link:
        request = kv_transfer_pb2.HandshakeRequest(
            compat=self.layout.to_compat(),
            decode_worker_id=self.worker_id,
            device_type=self.device.type,
        )
        offer = await peer.stub.Handshake(request, timeout=deadline.remaining())
        self._stats = replace(self._stats, handshakes=self._stats.handshakes + 1)
        try:
            backend = Backend(offer.backend)
        except ValueError:
            raise _ProtocolViolation(f"sender offered backend {offer.backend!r}") from None
        key = PairKey(offer.pair_id, offer.generation)
        group = await asyncio.to_thread(
            self._join, offer.store_host, offer.store_port, key, backend, deadline.remaining()
        )
        if self.ranks is not None:
            try:
                offers = [_pair_offer(o) for o in offer.rank_offers]
                await asyncio.to_thread(
                    self.ranks.join, peer.endpoint, offers, deadline.remaining()
                )
            except BaseException:
                await asyncio.to_thread(group.close)
                raise
        return _Link(group)

    def _join(
        self, host: str, port: int, key: PairKey, backend: Backend, timeout: float
    ) -> PairGroup:
        deadline = Deadline.after(timeout)
        store = open_store(host, port, deadline.remaining())
        wire_device = backend.wire_device(self.device)
        local_address = local_address_towards(host, port)
        return PairGroup.connect(
            store, key, Role.RECEIVER, backend, wire_device, local_address, deadline.remaining()
        )

    async def _transfer(
        self, peer: _Peer, link: _Link, pull: _PullRequest
    ) -> tuple[torch.Tensor, int | None]:
        buffer = self._wire_buffer(link.group.device, pull)
        tag = link.take_tag()
        pending = link.group.post_recv(buffer, tag)
        if self.ranks is None:
            return await self._transfer_posted(peer, link, pull, pending, None), None
        ranks = self.ranks
        pull_id = await asyncio.to_thread(ranks.post_recv, peer.endpoint, tag, len(pull.indices))
        try:
            packed = await self._transfer_posted(peer, link, pull, pending, pull_id)
        except BaseException:
            asyncio.get_running_loop().run_in_executor(None, ranks.discard, pull_id)
            raise
        return packed, pull_id

    async def _transfer_posted(
        self,
        peer: _Peer,
        link: _Link,
        pull: _PullRequest,
        pending: PendingRecv,
        pull_id: int | None,
    ) -> torch.Tensor:
        request = kv_transfer_pb2.PullBlocksRequest(
            lease_id=pull.lease_id,
            pair_id=link.group.key.pair_id,
            generation=link.group.key.generation,
            block_indices=pull.indices,
            tag=pending.tag,
        )
        reply = await peer.stub.PullBlocks(request, timeout=pull.deadline.remaining())
        expected = pending.tensor.numel() * pending.tensor.element_size()
        if reply.bytes_sent != expected:
            raise _ProtocolViolation(f"sender sent {reply.bytes_sent} bytes, not {expected}")
        landing = asyncio.to_thread(self._land, pending, pull, reply.checksum)
        if pull_id is None:
            return await landing
        others = asyncio.to_thread(
            self.ranks.land, pull_id, list(reply.rank_checksums), pull.deadline.remaining()
        )
        packed, _ = await asyncio.gather(landing, others)
        return packed

    def _land(self, pending: PendingRecv, pull: _PullRequest, expected: int) -> torch.Tensor:
        """Waits for the data, checks it against the sender's checksum (``_Corrupt``),
        then moves it to ``device`` if it arrived elsewhere."""
        pending.wait(pull.deadline.remaining())
        if checksum(pending.tensor) != expected:
            raise _Corrupt("the KV bytes received do not match the sender's checksum")
        if pull.out is None:
            return pending.tensor.to(self.device)
        return pull.out if pending.tensor is pull.out else pull.out.copy_(pending.tensor)

    def _wire_buffer(self, wire: torch.device, pull: _PullRequest) -> torch.Tensor:
        """Where the bytes land: ``out`` when it lives on the wire's device, else a new
        buffer there (pinned when it stages host memory for a CUDA receiver)."""
        if pull.out is not None and pull.out.device == wire:
            return pull.out
        shape = self.layout.packed_shape(len(pull.indices))
        pinned = wire.type == "cpu" and self.device.type == "cuda"
        return torch.empty(shape, dtype=self.layout.storage_dtype, device=wire, pin_memory=pinned)

    def _discard(self, peer: _Peer) -> None:
        """Drops the peer's pair; closing it (which fails any pending receive on both
        ends) runs in a thread so the event loop never waits on it."""
        link, peer.link = peer.link, None
        if link is not None:
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, link.group.close)
            if self.ranks is not None:
                loop.run_in_executor(None, _quietly, self.ranks.close_link, peer.endpoint)


def _pair_offer(offer: kv_transfer_pb2.RankOffer) -> PairOffer:
    try:
        backend = Backend(offer.backend)
    except ValueError:
        raise _ProtocolViolation(f"sender offered backend {offer.backend!r}") from None
    return PairOffer(
        PairKey(offer.pair_id, offer.generation), offer.store_host, offer.store_port, backend
    )


def _quietly(fn, *args) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so it compares equal to tensors' devices."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


async def _lease_call(
    method: grpc.aio.UnaryUnaryMultiCallable, endpoint: str, lease_id: str, timeout: float
) -> kv_transfer_pb2.LeaseResponse:
    try:
        return await method(kv_transfer_pb2.LeaseRequest(lease_id=lease_id), timeout=timeout)
    except grpc.aio.AioRpcError as error:
        raise LeaseCallFailed(
            f"lease {lease_id!r} at {endpoint}: {error.code().name}: {error.details()}"
        ) from error
