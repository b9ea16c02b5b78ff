"""KV transfer between tensor-parallel replicas: rank i sends to rank i.

Each rank holds the KV of its own heads, so a replica-to-replica transfer is N
independent rank-to-rank transfers, each over its own pair group, with no gather on
either side. The control path stays where it is: the decode worker's rank 0 talks gRPC
to the prefill worker's rank 0 (``Handshake``, ``PullBlocks``), and each rank 0 drives
its other ranks through the replica's call channel (``engine.parallel.control``):

- handshake: prefill rank 0 checks compatibility (the TP size is part of it) and makes
  an offer for every rank (``HandshakeResponse.rank_offers``); decode rank r joins
  prefill rank r's pair;
- pull: every decode rank posts its receive, prefill rank 0 resolves the lease to block
  ids and every prefill rank sends its heads' blocks (``PullBlocksResponse``
  carries each rank's checksum); every decode rank checks its bytes and keeps them
  staged;
- fill: on the engine thread, decode rank 0 writes its own blocks and sends the other
  ranks an ``UNPACK_KV`` plan, so they write theirs in step order (a request aborted
  meanwhile has its staged bytes dropped, never written into reused blocks).

``RankKVAgent`` is the handler on ranks 1..N-1; ``RankedSender`` and
``ReceiverRanks`` are rank 0's sides.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.parallel.control import RankControl, pass_error
from tandem.kvtransfer.blocks import checksum, unpack_blocks
from tandem.kvtransfer.errors import PairBroken, PairTimeout, UnknownPair
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.pair import (
    Backend,
    PairGroup,
    PairKey,
    PendingRecv,
    Role,
    local_address_towards,
    open_store,
)
from tandem.kvtransfer.sender import KVSender, PairOffer, SentBlocks
from tandem.protos import kv_transfer_pb2

for _kind in (PairBroken, PairTimeout, UnknownPair, ValueError):
    pass_error(_kind)


def transfer_layout(model: str, cache: Any, tp_size: int) -> KVLayout:
    """The ``KVLayout`` of one rank's cache (``model_runner.KVCacheLayout``)."""
    return KVLayout(model=model, tp_size=tp_size, **dataclasses.asdict(cache))


@dataclass(frozen=True)
class RankedOffer:
    """Rank 0's offer and the other ranks' (index 0 is rank 1)."""

    offer: PairOffer
    ranks: tuple[PairOffer, ...]


@dataclass(frozen=True)
class RankedSent:
    sent: SentBlocks
    rank_checksums: tuple[int, ...]


def offer_tuple(offer: PairOffer) -> tuple:
    key = offer.key
    return (key.pair_id, key.generation, offer.store_host, offer.store_port, offer.backend.value)


def offer_from_tuple(values: Sequence) -> PairOffer:
    pair_id, generation, host, port, backend = values
    return PairOffer(PairKey(pair_id, generation), host, port, Backend(backend))


class RankKVAgent:
    """On ranks 1..N-1: the transfers of this rank's heads, called by rank 0.

    A prefill rank hosts a ``KVSender`` over its cache (made on the first offer); a
    decode rank keeps one pair group per prefill endpoint and the bytes of pulls that
    landed but are not written yet (``unpack`` writes them, on the plan thread).
    """

    def __init__(
        self, layout: KVLayout, kv_caches: list[torch.Tensor], host: str, rank: int
    ) -> None:
        """``layout``: this rank's cache (its ``model`` is taken from the first offer's
        compatibility record, which rank 0 has checked in full)."""
        self.layout = layout
        self.rank = rank
        self.kv_caches = kv_caches
        self.host = host
        self._sender: KVSender | None = None
        self._links: dict[str, PairGroup] = {}
        self._staged: dict[int, PendingRecv | torch.Tensor] = {}
        self._lock = threading.Lock()

    # --- prefill side -------------------------------------------------------------------

    def kv_offer(self, decode_worker_id: str, compat: bytes, device_type: str) -> tuple:
        remote = kv_transfer_pb2.KVCompat.FromString(compat)
        if self._sender is None:
            layout = dataclasses.replace(self.layout, model=remote.model)
            self._sender = KVSender(layout, self.kv_caches, self.host, 0, f"rank{self.rank}")
        return offer_tuple(self._sender.handshake(decode_worker_id, remote, device_type))

    def kv_send(
        self, pair_id: str, generation: int, block_ids: list[int], tag: int, timeout: float
    ):
        if self._sender is None:
            raise UnknownPair(f"no pair {pair_id!r} on this rank: handshake first")
        sent = self._sender.send_blocks(pair_id, generation, block_ids, tag, timeout)
        return sent.nbytes, sent.checksum

    # --- decode side --------------------------------------------------------------------

    def kv_join(self, endpoint: str, offer: tuple, device_type: str, timeout: float) -> None:
        self.kv_close_link(endpoint)
        offer_ = offer_from_tuple(offer)
        store = open_store(offer_.store_host, offer_.store_port, timeout)
        device = offer_.backend.wire_device(torch.device(device_type))
        local = local_address_towards(offer_.store_host, offer_.store_port)
        group = PairGroup.connect(
            store, offer_.key, Role.RECEIVER, offer_.backend, device, local, timeout
        )
        with self._lock:
            self._links[endpoint] = group

    def kv_post_recv(self, endpoint: str, pull_id: int, tag: int, num_blocks: int) -> None:
        with self._lock:
            link = self._links.get(endpoint)
        if link is None:
            raise PairBroken(f"no pair with {endpoint} on this rank")
        shape = self.layout.packed_shape(num_blocks)
        buffer = torch.empty(shape, dtype=self.layout.storage_dtype, device=link.device)
        pending = link.post_recv(buffer, tag)
        with self._lock:
            self._staged[pull_id] = pending

    def kv_land(self, pull_id: int, expected: int, timeout: float) -> None:
        with self._lock:
            pending = self._staged.get(pull_id)
        if not isinstance(pending, PendingRecv):
            raise PairBroken(f"pull {pull_id} was not posted on this rank")
        try:
            pending.wait(timeout)
            if checksum(pending.tensor) != expected:
                raise PairBroken("the KV bytes received do not match the sender's checksum")
        except PairBroken:
            self.kv_discard(pull_id)
            raise
        with self._lock:
            self._staged[pull_id] = pending.tensor.to(self.kv_caches[0].device)

    def kv_unpack(self, pull_id: int, block_ids: list[int]) -> None:
        """Plan thread: writes a landed pull into ``block_ids``."""
        with self._lock:
            packed = self._staged.pop(pull_id, None)
        if isinstance(packed, torch.Tensor):
            unpack_blocks(self.kv_caches, block_ids, packed)

    def kv_discard(self, pull_id: int) -> None:
        with self._lock:
            self._staged.pop(pull_id, None)

    def kv_close_link(self, endpoint: str) -> None:
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        if self._sender is not None:
            self._sender.close()


class RankedSender:
    """Prefill rank 0: its own ``KVSender`` plus the other ranks', driven together.
    Pairs of the other ranks are remembered by rank 0's pair and generation."""

    def __init__(self, sender: KVSender, control: RankControl) -> None:
        self.sender = sender
        self.control = control
        self._rank_pairs: dict[tuple[str, int], tuple[PairOffer, ...]] = {}
        self._lock = threading.Lock()
        self._others = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-ranks")

    def handshake(
        self, decode_worker_id: str, remote: kv_transfer_pb2.KVCompat, remote_device_type: str
    ) -> RankedOffer:
        offer = self.sender.handshake(decode_worker_id, remote, remote_device_type)
        compat = remote.SerializeToString()
        offers = self.control.call_all(
            "kv_offer", lambda r: (decode_worker_id, compat, remote_device_type)
        )
        ranks = tuple(offer_from_tuple(o) for o in offers)
        with self._lock:
            stale = [k for k in self._rank_pairs if k[0] == offer.key.pair_id]
            for k in stale:
                del self._rank_pairs[k]
            self._rank_pairs[(offer.key.pair_id, offer.key.generation)] = ranks
        return RankedOffer(offer, ranks)

    def send_blocks(
        self, pair_id: str, generation: int, block_ids: Sequence[int], tag: int, timeout: float
    ) -> RankedSent:
        with self._lock:
            ranks = self._rank_pairs.get((pair_id, generation))
        if ranks is None:
            raise UnknownPair(f"no pair {pair_id!r} generation {generation} across the ranks")
        ids = list(block_ids)
        others = self._others.submit(
            self.control.call_all,
            "kv_send",
            lambda r: (*_pair_args(ranks[r - 1]), ids, tag, timeout),
        )
        sent = self.sender.send_blocks(pair_id, generation, ids, tag, timeout)
        results = others.result()
        return RankedSent(sent, tuple(checksum_ for _, checksum_ in results))

    def close(self) -> None:
        self.sender.close()
        self._others.shutdown(wait=False)


def _pair_args(offer: PairOffer) -> tuple[str, int]:
    return offer.key.pair_id, offer.key.generation


class ReceiverRanks:
    """Decode rank 0: drives the other ranks' side of each pull."""

    def __init__(self, control: RankControl, device_type: str) -> None:
        self.control = control
        self.device_type = device_type
        self._ids = itertools.count(1)

    @property
    def size(self) -> int:
        return self.control.size

    def join(self, endpoint: str, offers: Sequence[PairOffer], timeout: float) -> None:
        if len(offers) != self.size - 1:
            raise PairBroken(
                f"prefill worker {endpoint} offered pairs for {len(offers) + 1} ranks, "
                f"this replica has {self.size}"
            )
        self.control.call_all(
            "kv_join",
            lambda r: (endpoint, offer_tuple(offers[r - 1]), self.device_type, timeout),
        )

    def post_recv(self, endpoint: str, tag: int, num_blocks: int) -> int:
        pull_id = next(self._ids)
        self.control.call_all("kv_post_recv", lambda r: (endpoint, pull_id, tag, num_blocks))
        return pull_id

    def land(self, pull_id: int, checksums: Sequence[int], timeout: float) -> None:
        if len(checksums) != self.size - 1:
            raise PairBroken(f"sender gave {len(checksums)} rank checksums for {self.size - 1}")
        self.control.call_all("kv_land", lambda r: (pull_id, checksums[r - 1], timeout))

    def discard(self, pull_id: int) -> None:
        self.control.call_all("kv_discard", lambda r: (pull_id,))

    def close_link(self, endpoint: str) -> None:
        self.control.call_all("kv_close_link", lambda r: (endpoint,))
