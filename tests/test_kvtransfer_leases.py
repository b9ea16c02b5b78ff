"""Lease table: grant / renew / release / expiry on a fake clock; every lease's blocks
come back exactly once, whichever way it ends."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tandem.kvtransfer.leases import LeaseTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock)


def test_grant_then_release_returns_blocks_once(table: LeaseTable) -> None:
    lease = table.grant("req-1", [4, 5, 6], ttl=10)
    assert table.block_ids(lease) == [4, 5, 6] and len(table) == 1
    assert table.release(lease).ended.block_ids == (4, 5, 6)
    assert not table.release(lease).found
    assert table.block_ids(lease) is None and len(table) == 0


def test_expiry_and_sweep(table: LeaseTable, clock: FakeClock) -> None:
    short = table.grant("req-1", [1], ttl=5)
    long = table.grant("req-2", [2, 3], ttl=50)
    clock.now += 5
    assert table.block_ids(short) is None  # expired, even before the sweep
    assert table.block_ids(long) == [2, 3]
    swept = table.expired()
    assert [(s.lease_id, s.request_id, s.block_ids) for s in swept] == [(short, "req-1", (1,))]
    assert table.expired() == [] and not table.release(short).found
    assert len(table) == 1


def test_renew_extends_by_ttl_from_now(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("req-1", [1], ttl=10)
    clock.now += 8
    assert table.renew(lease)
    assert table.time_left(lease) == pytest.approx(10)
    clock.now += 9
    assert table.expired() == [] and table.block_ids(lease) == [1]
    clock.now += 1
    assert not table.renew(lease)  # too late: the sweep owns it now
    assert [s.block_ids for s in table.expired()] == [(1,)]
    assert not table.renew("no-such-lease")


def test_expired_but_unswept_lease_can_still_be_released(
    table: LeaseTable, clock: FakeClock
) -> None:
    lease = table.grant("req-1", [7, 8], ttl=1)
    clock.now += 2
    assert table.release(lease).ended.block_ids == (7, 8)
    assert table.expired() == []


def test_release_during_a_pull_defers_blocks_to_unpin(table: LeaseTable) -> None:
    lease = table.grant("req-1", [3, 4], ttl=10)
    assert table.pin(lease) == [3, 4]
    assert table.pin(lease) == [3, 4]
    first = table.release(lease)
    assert first.found and first.ended is None  # a pull is reading: not yours to free yet
    assert not table.release(lease).found
    assert table.pin(lease) is None  # no new readers of a released lease
    assert table.unpin(lease) is None
    assert table.unpin(lease).block_ids == (3, 4)  # the last reader hands them back
    assert len(table) == 0
    with pytest.raises(ValueError, match="not pinned"):
        table.unpin(lease)


def test_pinned_lease_does_not_expire_until_unpinned(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.grant("req-1", [9], ttl=1)
    table.pin(lease)
    clock.now += 5
    assert table.expired() == []
    assert table.unpin(lease) is None
    assert [s.block_ids for s in table.expired()] == [(9,)]


def test_explicit_sweep_time(table: LeaseTable) -> None:
    lease = table.grant("req-1", [1], ttl=10)
    assert table.expired(now=105.0) == []
    assert [s.lease_id for s in table.expired(now=110.0)] == [lease]


def test_bad_grants_are_refused(table: LeaseTable) -> None:
    with pytest.raises(ValueError):
        table.grant("req-1", [], ttl=1)
    with pytest.raises(ValueError):
        table.grant("req-1", [1], ttl=0)


def test_concurrent_release_and_sweep_free_each_block_once(
    table: LeaseTable, clock: FakeClock
) -> None:
    leases = [table.grant(f"req-{i}", [i], ttl=1) for i in range(2000)]
    clock.now += 1
    freed: list[int] = []
    lock = threading.Lock()

    def release_all() -> None:
        for lease in leases:
            ended = table.release(lease).ended
            ids = list(ended.block_ids) if ended else []
            with lock:
                freed.extend(ids)

    def sweep() -> None:
        for _ in range(50):
            ids = [b for s in table.expired() for b in s.block_ids]
            with lock:
                freed.extend(ids)

    threads = [threading.Thread(target=release_all), threading.Thread(target=sweep)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    freed.extend(b for s in table.expired() for b in s.block_ids)
    assert sorted(freed) == list(range(2000))


def test_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import tandem.kvtransfer.leases, tandem.kvtransfer.errors"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
