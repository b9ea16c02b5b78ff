"""A two-rank torch.distributed group between one prefill worker and one decode worker.

Rank 0 is the sender (prefill), rank 1 the receiver (decode). Each pair gets its own
process group, built from a ``PrefixStore(f"{pair_id}/{generation}/", store)`` on the
rendezvous store the prefill worker hosts, so no global ``init_process_group`` is needed
and a process can hold many pairs. A group is never repaired: after any failure it is
closed and the decode worker handshakes a new generation.

Nothing here blocks without a timeout. Collectives have none of their own, so every wait
is ``Work.wait(timeout)``; a timeout breaks the group (gloo closes the connection itself).

What gloo does, measured on torch 2.13 CPU:

- The constructor blocks until both ranks join, honouring its ``timeout``
  (``DistStoreError: wait timeout``).
- A dead peer shows up within milliseconds as "Connection closed by peer" on the
  pending and every later operation; so does a peer that dropped its group.
- A timed-out operation closes the connection ("Application timeout caused pair
  closure"), waking every pending operation on both sides with an error. A timed-out
  recv is therefore safe to abandon: nothing is written into its buffer later.
  One exception: a send posted on the peer right after, with the tag of the abandoned
  recv (whose readiness gloo had already announced), may miss the closure and wait out
  its own timeout; so a sender's wait is only as short as its deadline.
- ``abort()`` and ``shutdown()`` do not wake a thread blocked in ``wait``, and dropping
  the group only closes its sockets; so ``close`` deliberately times out a 1 ms receive.
- ``Work.wait(timedelta(0))`` means "no timeout", hence the 1 ms floor in ``_wait``.
- One ``TCPStore`` client cannot serve two threads blocked in rendezvous at once (they
  time out), so every group gets its own client connection (``open_store``).
"""

from __future__ import annotations

import enum
import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.kvtransfer.deadline import Deadline
from tandem.kvtransfer.errors import PairBroken, PairTimeout

FIRST_TAG = 1
"""Tags for ``send``/``recv`` run from ``FIRST_TAG`` to ``LAST_TAG`` (gloo tags are C ints)."""
LAST_TAG = 2**31 - 2
_HELLO_TAG = 0
_CLOSE_TAG = 2**31 - 1
_MIN_WAIT_S = 0.001


class Backend(enum.Enum):
    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def between(cls, sender_device_type: str, receiver_device_type: str) -> Backend:
        """NCCL when both ends are CUDA, else gloo."""
        both_cuda = sender_device_type == receiver_device_type == "cuda"
        return cls.NCCL if both_cuda else cls.GLOO

    def wire_device(self, device: torch.device) -> torch.device:
        """Where tensors on the wire live: NCCL moves device memory, gloo host memory."""
        return device if self is Backend.NCCL else torch.device("cpu")


class Role(enum.IntEnum):
    """The rank in the pair group."""

    SENDER = 0
    RECEIVER = 1


@dataclass(frozen=True)
class PairKey:
    pair_id: str
    generation: int

    @property
    def store_prefix(self) -> str:
        return f"{self.pair_id}/{self.generation}/"

    def __str__(self) -> str:
        return f"{self.pair_id}#{self.generation}"


def next_tag(tag: int) -> int:
    """The tag after ``tag``, wrapping from ``LAST_TAG`` to ``FIRST_TAG``."""
    return tag + 1 if tag < LAST_TAG else FIRST_TAG


def local_address_towards(host: str, port: int) -> str:
    """The local IP address that routes to ``host:port`` (no packet is sent).

    Gloo's default device binds to whatever the hostname resolves to, which is loopback
    on some machines (this one), so a pair built that way works only on one host.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def open_store(host: str, port: int, timeout: float) -> dist.Store:
    """A new client connection to a rendezvous ``TCPStore``; raises ``PairBroken`` when
    it cannot connect within ``timeout`` seconds. The caller owns the connection."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=_timedelta(timeout))
    except RuntimeError as error:
        reason = _first_line(error)
        raise PairBroken(f"cannot reach rendezvous store {host}:{port}: {reason}") from error


class PairGroup:
    """One generation of a pair's process group, and the tensors it moves.

    Thread-safe to call from any thread, but the caller orders operations: NCCL matches
    point-to-point operations by issue order, not by tag, so one pair runs one transfer
    at a time. Every failure marks the group broken (``broken_reason``) and raises
    ``PairBroken`` (``PairTimeout`` when time ran out); later calls raise at once.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        key: PairKey,
        role: Role,
        backend: Backend,
        device: torch.device,
    ) -> None:
        """Use ``connect``; this takes ownership of a joined ``group``."""
        self.key = key
        self.role = role
        self.backend = backend
        self.device = device
        self._group: dist.ProcessGroup | None = group
        self._peer = int(Role.RECEIVER if role is Role.SENDER else Role.SENDER)
        self.broken_reason: str | None = None

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        key: PairKey,
        role: Role,
        backend: Backend,
        device: torch.device,
        local_address: str,
        timeout: float,
    ) -> PairGroup:
        """Joins the pair's group on ``store`` and exchanges a first message.

        Blocks until the peer joins or ``timeout`` seconds pass (``PairTimeout``).
        ``device`` is where the pair's tensors live (``Backend.wire_device``). Gloo binds
        its sockets to ``local_address``, which the peer must be able to reach; NCCL
        chooses its own (``NCCL_SOCKET_IFNAME``). The first message proves data flows
        (NCCL only creates its communicator there) and that both ends joined the same
        generation.
        """
        deadline = Deadline.after(timeout)
        prefixed = dist.PrefixStore(key.store_prefix, store)
        try:
            timeout_td = _timedelta(deadline.remaining())
            group = _new_group(backend, prefixed, role, local_address, timeout_td)
        except RuntimeError as error:
            kind = PairTimeout if deadline.expired else PairBroken
            raise kind(f"pair {key} did not form: {_first_line(error)}") from error
        pair = cls(group, key, role, backend, device)
        try:
            pair._hello(deadline)
        except PairBroken:
            pair.close()
            raise
        return pair

    @property
    def broken(self) -> bool:
        return self.broken_reason is not None

    def send(self, tensor: torch.Tensor, tag: int, timeout: float) -> None:
        """Sends a contiguous ``tensor`` to the peer's matching ``recv``; returns once the
        send completed (the tensor may be reused). Waits at most ``timeout`` seconds."""
        _check_tag(tag)
        self._send(tensor, tag, Deadline.after(timeout))

    def post_recv(self, tensor: torch.Tensor, tag: int) -> PendingRecv:
        """Posts a receive into a contiguous ``tensor`` without waiting. The tensor must
        stay untouched until the returned ``PendingRecv.wait`` succeeds or the group is
        closed (the pending receive keeps it alive)."""
        _check_tag(tag)
        return self._post_recv(tensor, tag)

    def recv(self, tensor: torch.Tensor, tag: int, timeout: float) -> None:
        """``post_recv`` then wait at most ``timeout`` seconds for the data."""
        self.post_recv(tensor, tag).wait(timeout)

    def close(self) -> None:
        """Fails every pending operation on both ends and releases the group. Idempotent;
        never raises. After it, every call raises ``PairBroken``."""
        group, self._group = self._group, None
        if self.broken_reason is None:
            self.broken_reason = "closed"
        if group is None:
            return
        try:
            if self.backend is Backend.NCCL:
                group.abort()
            else:  # a timed-out gloo op closes the connection and wakes all waiters
                probe = torch.empty(1, device=self.device)
                group.recv([probe], self._peer, _CLOSE_TAG).wait(_timedelta(_MIN_WAIT_S))
        except RuntimeError:
            pass  # the expected timeout, or the group was already broken

    def _send(self, tensor: torch.Tensor, tag: int, deadline: Deadline) -> None:
        group = self._live_group()
        try:
            work = group.send([tensor], self._peer, tag)
        except RuntimeError as error:
            raise self._broke("send", error, timed_out=False) from error
        self._wait(work, "send", deadline)

    def _post_recv(self, tensor: torch.Tensor, tag: int) -> PendingRecv:
        group = self._live_group()
        try:
            work = group.recv([tensor], self._peer, tag)
        except RuntimeError as error:
            raise self._broke("recv", error, timed_out=False) from error
        return PendingRecv(self, work, tensor, tag)

    def _wait(self, work: dist.Work, what: str, deadline: Deadline) -> None:
        timeout = max(deadline.remaining(), _MIN_WAIT_S)
        try:
            completed = work.wait(_timedelta(timeout))
        except RuntimeError as error:
            raise self._broke(what, error, timed_out=deadline.expired) from error
        if not completed:
            raise self._broke(what, TimeoutError("not completed"), timed_out=True)

    def _hello(self, deadline: Deadline) -> None:
        expected = torch.tensor([self.key.generation], dtype=torch.int64, device=self.device)
        if self.role is Role.SENDER:
            self._send(expected, _HELLO_TAG, deadline)
            return
        got = torch.zeros_like(expected)
        self._wait(self._post_recv(got, _HELLO_TAG).work, "hello", deadline)
        if not torch.equal(got, expected):
            mismatch = ValueError(f"peer sent generation {got.item()}")
            raise self._broke("hello", mismatch, timed_out=False)

    def _live_group(self) -> dist.ProcessGroup:
        if self.broken_reason is not None or self._group is None:
            raise PairBroken(f"pair {self.key} is unusable: {self.broken_reason}")
        return self._group

    def _broke(self, what: str, error: Exception, *, timed_out: bool) -> PairBroken:
        """Marks the group broken and returns the error to raise."""
        if timed_out:
            broken: PairBroken = PairTimeout(f"pair {self.key}: {what} timed out")
        else:
            broken = PairBroken(f"pair {self.key}: {what} failed: {_first_line(error)}")
        self.broken_reason = str(broken)
        return broken


class PendingRecv:
    """A posted receive. Holds the buffer and the group until waited for or dropped."""

    def __init__(
        self, pair: PairGroup, work: dist.Work, tensor: torch.Tensor, tag: int = 0
    ) -> None:
        self.pair = pair
        self.work = work
        self.tensor = tensor
        self.tag = tag

    def wait(self, timeout: float) -> None:
        """Returns once the data is in ``tensor``; raises ``PairTimeout`` after ``timeout``
        seconds or ``PairBroken`` when the peer is lost (either breaks the pair)."""
        self.pair._wait(self.work, "recv", Deadline.after(timeout))


def _new_group(
    backend: Backend, store: dist.Store, role: Role, local_address: str, timeout: timedelta
) -> dist.ProcessGroup:
    if backend is Backend.NCCL:
        # Read when the group is built. The default (3) kills the whole worker when an
        # operation outlives the group timeout; 2 only aborts the communicator, which is
        # what a timed-out transfer calls for: the pair is rebuilt, the worker lives on.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        return dist.ProcessGroupNCCL(store, int(role), 2, timeout)
    options = dist.ProcessGroupGloo._Options()  # as torch's own new_group builds it
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    return dist.ProcessGroupGloo(store, int(role), 2, options)


def _check_tag(tag: int) -> None:
    if not FIRST_TAG <= tag <= LAST_TAG:
        raise ValueError(f"tag {tag} outside [{FIRST_TAG}, {LAST_TAG}]")


def _timedelta(seconds: float) -> timedelta:
    """At least ``_MIN_WAIT_S``, rounded up to whole ms plus one: gloo truncates to ms,
    and a wait that ends before our deadline would be misreported as a lost peer."""
    return timedelta(milliseconds=math.ceil(max(seconds, _MIN_WAIT_S) * 1000) + 1)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
