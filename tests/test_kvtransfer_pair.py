"""Pair groups over real gloo and a real TCPStore: both ranks in this process, on threads.
Nothing may block past its timeout, and a failure breaks the pair on both ends."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tandem.kvtransfer.errors import PairBroken, PairTimeout
from tandem.kvtransfer.pair import Backend, PairGroup, PairKey, Role, open_store

CPU = torch.device("cpu")


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


JOIN_TIMEOUT_S = 10.0
"""Also the pair's own (gloo) timeout: what a wait that ignored its deadline would take."""


def _join(
    store: dist.TCPStore, key: PairKey, role: Role, timeout: float = JOIN_TIMEOUT_S
) -> PairGroup:
    client = open_store("127.0.0.1", store.port, timeout)
    return PairGroup.connect(client, key, role, Backend.GLOO, CPU, "127.0.0.1", timeout)


@pytest.fixture
def pair(store: dist.TCPStore) -> Iterator[tuple[PairGroup, PairGroup]]:
    key = PairKey("p->d", 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sender = pool.submit(_join, store, key, Role.SENDER)
        receiver = pool.submit(_join, store, key, Role.RECEIVER)
        groups = (sender.result(), receiver.result())
    yield groups
    for group in groups:
        group.close()


def test_backend_choice() -> None:
    assert Backend.between("cuda", "cuda") is Backend.NCCL
    assert Backend.between("cuda", "cpu") is Backend.GLOO
    assert Backend.between("cpu", "cpu") is Backend.GLOO
    assert Backend.GLOO.wire_device(torch.device("cuda", 1)) == CPU


@pytest.mark.timeout(30)
def test_send_recv_by_tag(pair: tuple[PairGroup, PairGroup]) -> None:
    sender, receiver = pair
    a, b = torch.zeros(1000), torch.zeros(10)
    pending_b = receiver.post_recv(b, tag=8)
    pending_a = receiver.post_recv(a, tag=7)
    sender.send(torch.arange(1000.0), tag=7, timeout=5)
    sender.send(torch.ones(10), tag=8, timeout=5)
    pending_a.wait(5)
    pending_b.wait(5)
    assert torch.equal(a, torch.arange(1000.0)) and torch.equal(b, torch.ones(10))


@pytest.mark.timeout(30)
def test_recv_timeout_breaks_both_ends(pair: tuple[PairGroup, PairGroup]) -> None:
    sender, receiver = pair
    buffer = torch.zeros(4)
    started = time.monotonic()
    with pytest.raises(PairTimeout):
        receiver.recv(buffer, tag=1, timeout=0.5)
    # At its own 0.5 s, not the group's 10 s; the slack is for a loaded machine.
    assert 0.4 < time.monotonic() - started < JOIN_TIMEOUT_S / 2
    assert receiver.broken
    with pytest.raises(PairBroken):
        receiver.recv(torch.zeros(4), tag=2, timeout=0.5)
    # gloo closed the connection: the sender learns at once, not after its timeout. (Not
    # on tag 1: a send matching the receive the peer announced and then abandoned can
    # miss the closure and wait out its own timeout; see kvtransfer/pair.py.)
    started = time.monotonic()
    with pytest.raises(PairBroken) as lost:
        sender.send(torch.ones(4), tag=2, timeout=10)
    assert not isinstance(lost.value, PairTimeout)
    assert time.monotonic() - started < 10 / 2  # half the send's own timeout: not waited out
    assert not buffer.any()  # the abandoned receive never lands


@pytest.mark.timeout(30)
def test_close_wakes_a_pending_recv_on_both_ends(pair: tuple[PairGroup, PairGroup]) -> None:
    sender, receiver = pair
    pending = sender.post_recv(torch.zeros(4), tag=3)  # a recv on the sender, for symmetry
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(receiver.recv, torch.zeros(4), 5, 20.0)
        time.sleep(0.3)
        started = time.monotonic()
        receiver.close()
        with pytest.raises(PairBroken):
            waiting.result(timeout=5)
    with pytest.raises(PairBroken):
        pending.wait(10)
    assert time.monotonic() - started < 10 / 2  # half the shortest wait: woken, not timed out


@pytest.mark.timeout(30)
def test_join_times_out_without_a_peer(store: dist.TCPStore) -> None:
    started = time.monotonic()
    with pytest.raises(PairTimeout, match="did not form"):
        _join(store, PairKey("p->nobody", 1), Role.SENDER, timeout=1.0)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(30)
def test_unreachable_store_is_reported() -> None:
    with pytest.raises(PairBroken, match="rendezvous store"):
        open_store("127.0.0.1", 1, timeout=1.0)


def test_tags_are_range_checked(pair: tuple[PairGroup, PairGroup]) -> None:
    with pytest.raises(ValueError, match="tag"):
        pair[0].send(torch.zeros(1), tag=0, timeout=1)
