"""Leases on a prefill worker's finished KV blocks, awaiting a decode worker's pull.

Torch-free and thread-safe: the gRPC server's thread and the engine thread both call it.

Block ownership. ``grant`` takes a reference on the blocks for the lease (the prefill
worker must not free or overwrite them while leased). Every granted lease's blocks come
back to the caller exactly once, through one of:

- ``release`` -> the block ids (or ``[]`` when a pull is reading the lease; then ...)
- ``unpin``   -> ... the last reader's ``unpin`` returns them;
- ``expired`` -> leases whose TTL passed, for a periodic sweep.

Whoever receives ids must free them (in the prefill worker: on its engine thread). A
pinned lease (being read by a pull) neither expires nor gives its blocks back until it is
unpinned, so a sweep or a release never frees blocks under a running send.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EndedLease:
    """A lease whose blocks are now the caller's to free (released or expired)."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    """What ``release`` did: ``found`` the lease; ``ended`` is set when its blocks are
    to be freed now, ``None`` while a pull still reads them (the last ``unpin`` then
    returns the ``EndedLease``)."""

    found: bool
    ended: EndedLease | None = None


@dataclass
class _Lease:
    request_id: str
    block_ids: tuple[int, ...]
    ttl: float
    expires_at: float
    pins: int = 0
    released: bool = False


class LeaseTable:
    """lease_id -> (request_id, block ids, expiry).

    ``clock`` returns seconds on a monotonic scale (default ``time.monotonic``); tests
    inject a fake one. ``len()`` counts leases whose blocks are still held.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}

    def grant(self, request_id: str, block_ids: Sequence[int], ttl: float) -> str:
        """New lease on ``block_ids`` for ``ttl`` seconds; returns its id."""
        if not block_ids:
            raise ValueError("a lease needs at least one block")
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        lease_id = uuid.uuid4().hex
        with self._lock:
            expires_at = self._clock() + ttl
            self._leases[lease_id] = _Lease(request_id, tuple(block_ids), ttl, expires_at)
        return lease_id

    def block_ids(self, lease_id: str) -> list[int] | None:
        """The lease's block ids; ``None`` when it is unknown, released or expired."""
        with self._lock:
            lease = self._live(lease_id)
            return None if lease is None else list(lease.block_ids)

    def time_left(self, lease_id: str) -> float | None:
        """Seconds until the lease expires; ``None`` when it is not live."""
        with self._lock:
            lease = self._live(lease_id)
            return None if lease is None else lease.expires_at - self._clock()

    def renew(self, lease_id: str) -> bool:
        """Extends a live lease by its TTL from now; ``False`` when not live (too late)."""
        with self._lock:
            lease = self._live(lease_id)
            if lease is not None:
                lease.expires_at = self._clock() + lease.ttl
            return lease is not None

    def release(self, lease_id: str) -> Release:
        """Ends the lease (see ``Release``); not found when it is unknown or already
        released/swept. An expired, unswept lease is released."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.released:
                return Release(found=False)
            if lease.pins:
                lease.released = True
                return Release(found=True)
            del self._leases[lease_id]
            return Release(True, EndedLease(lease_id, lease.request_id, lease.block_ids))

    def pin(self, lease_id: str) -> list[int] | None:
        """Marks a live lease as being read and returns its block ids (``None`` when not
        live). Until the matching ``unpin`` it neither expires nor frees its blocks."""
        with self._lock:
            lease = self._live(lease_id)
            if lease is None:
                return None
            lease.pins += 1
            return list(lease.block_ids)

    def unpin(self, lease_id: str) -> EndedLease | None:
        """Ends one ``pin``. Returns the lease whose blocks the caller must free now (it
        was released while pinned and this was the last reader), else ``None``. A lease
        that expired while pinned is left for the next ``expired`` sweep."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.pins == 0:
                raise ValueError(f"lease {lease_id!r} is not pinned")
            lease.pins -= 1
            if lease.pins or not lease.released:
                return None
            del self._leases[lease_id]
            return EndedLease(lease_id, lease.request_id, lease.block_ids)

    def expired(self, now: float | None = None) -> list[EndedLease]:
        """Removes and returns the unpinned, unreleased leases that expired at ``now``
        (default: the table's clock). The caller frees their blocks."""
        with self._lock:
            at = self._clock() if now is None else now
            gone = [
                lease_id
                for lease_id, lease in self._leases.items()
                if lease.expires_at <= at and not lease.pins and not lease.released
            ]
            leases = [(lease_id, self._leases.pop(lease_id)) for lease_id in gone]
        return [EndedLease(i, lease.request_id, lease.block_ids) for i, lease in leases]

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _live(self, lease_id: str) -> _Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.released or lease.expires_at <= self._clock():
            return None
        return lease
