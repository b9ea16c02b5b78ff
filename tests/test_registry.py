"""Worker registry against a real Redis: what a router's watcher sees, and how fast."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis

from tandem.common.redis_server import EmbeddedRedis
from tandem.common.registry import (
    RegistryDecodeError,
    RegistryKeys,
    RegistryWatcher,
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WorkerRegistration,
    WorkerRole,
    decode_record,
    encode_record,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny-llama"
FAST_POLL_S = 0.1


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def make_info(
    worker_id: str,
    role: WorkerRole = WorkerRole.PREFILL,
    model: str = MODEL,
    address: str = "127.0.0.1:50051",
) -> WorkerInfo:
    capacity = WorkerCapacity(num_kv_blocks=128, block_size=16, max_num_seqs=8)
    return WorkerInfo(worker_id, role, address, model, capacity, kv_endpoint="tcp://x:1")


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


# ------------------------------------------------------------------------ the codec


def test_record_round_trips_through_json() -> None:
    adapters = {"sql": "lora:sql:0123456789abcdef"}
    load = WorkerLoad(100, 2, 3, 456, updated_at=12.5, busy_fraction=0.25, adapters=adapters)
    record = WorkerRecord(make_info("w1"), load)
    assert decode_record(encode_record(record), "k") == record
    assert decode_record(encode_record(record), "k").load.adapters == adapters
    # A record from a worker that does not report its busy share reads as 0.
    doc = json.loads(encode_record(record))
    del doc["load"]["busy_fraction"]
    assert decode_record(json.dumps(doc), "k").load.busy_fraction == 0.0


def test_busy_meter_tracks_the_recent_share_of_time_spent_stepping() -> None:
    from tandem.common.worker_load import BusyMeter

    now = [0.0]
    meter = BusyMeter(window_s=10.0, clock=lambda: now[0])
    busy = 0.0
    assert meter.update(busy) == 0.0
    for _ in range(100):  # busy 0.3 s of every second for 100 s
        now[0] += 1.0
        busy += 0.3
        share = meter.update(busy)
    assert abs(share - 0.3) < 1e-3
    for _ in range(30):  # then idle: it decays with the 10 s time constant
        now[0] += 1.0
        share = meter.update(busy)
    assert 0.01 < share < 0.3 * 0.06


def test_a_new_busy_meter_reports_what_it_saw_not_a_ramp_from_zero() -> None:
    """Two seconds after start at 75% busy, the meter says 0.75 (an uncorrected decayed
    average would say 0.75 x (1 - e^-0.2) = 0.14); then it follows changes with its time
    constant as before."""
    from tandem.common.worker_load import BusyMeter

    now = [0.0]
    meter = BusyMeter(window_s=10.0, clock=lambda: now[0])
    busy = 0.0
    meter.update(busy)
    for _ in range(2):
        now[0] += 1.0
        busy += 0.75
        share = meter.update(busy)
    assert abs(share - 0.75) < 1e-9
    now[0] += 10.0  # ten idle seconds outweigh the two busy ones (decayed): about 0.07
    share = meter.update(busy)
    assert 0.05 < share < 0.1


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda doc: doc.update(schema_version=2), "unknown schema_version 2"),
        (lambda doc: doc.pop("load"), "missing field 'load'"),
        (lambda doc: doc["info"].update(role="janitor"), "'janitor' is not a valid WorkerRole"),
        (lambda doc: doc["load"].update(free_kv_blocks=True), "'free_kv_blocks' has the wrong"),
        (lambda doc: doc["load"].update(num_running_seqs=-1), "num_running_seqs must be >= 0"),
        (lambda doc: doc["info"]["capacity"].update(block_size="16"), "'block_size' has the wr"),
    ],
)
def test_decoding_rejects_bad_entries_with_the_reason(
    mutate: Callable[[dict[str, Any]], object], reason: str
) -> None:
    doc = json.loads(encode_record(WorkerRecord(make_info("w1"), WorkerLoad(1, 0, 0, 0))))
    mutate(doc)
    with pytest.raises(RegistryDecodeError, match=reason) as caught:
        decode_record(json.dumps(doc), "the-key")
    assert caught.value.key == "the-key"


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_decoding_rejects_non_objects(raw: bytes) -> None:
    with pytest.raises(RegistryDecodeError, match="the-key"):
        decode_record(raw, "the-key")


# -------------------------------------------------------------- worker <-> watcher


def test_registered_worker_is_seen_with_its_info_and_load(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        joined: list[WorkerRecord] = []
        async with (
            RegistryWatcher(redis_url, MODEL, prefix=prefix, on_join=joined.append) as watcher,
            WorkerRegistration(redis_url, prefix=prefix) as worker,
        ):
            info, load = make_info("p1"), WorkerLoad(120, 1, 2, 300)
            await worker.register(info, load)
            await wait_until(lambda: watcher.get("p1") is not None)
            expected = WorkerRecord(info, load)
            assert watcher.get("p1") == expected
            assert watcher.workers(WorkerRole.PREFILL) == (expected,)
            assert watcher.workers(WorkerRole.DECODE) == ()
            assert joined == [expected]

    run(scenario())


def test_heartbeat_updates_the_load(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            RegistryWatcher(redis_url, MODEL, prefix=prefix, poll_interval_s=FAST_POLL_S) as w,
            WorkerRegistration(redis_url, prefix=prefix) as worker,
        ):
            await worker.register(make_info("d1", WorkerRole.DECODE))
            await wait_until(lambda: w.get("d1") is not None)
            assert w.get("d1").load.free_kv_blocks == 128  # the idle load
            busy = WorkerLoad(
                free_kv_blocks=7,
                num_running_seqs=8,
                num_waiting_seqs=5,
                num_queued_prefill_tokens=0,
            )
            await worker.heartbeat(busy)
            await wait_until(lambda: w.get("d1").load == busy)

    run(scenario())


def test_deregister_is_seen_at_once_through_the_notice(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        left: list[WorkerRecord] = []
        slow_poll = 30.0  # only the pub/sub notice can make the watcher this quick
        async with RegistryWatcher(
            redis_url, MODEL, prefix=prefix, poll_interval_s=slow_poll, on_leave=left.append
        ) as watcher:
            worker = WorkerRegistration(redis_url, prefix=prefix)
            await worker.register(make_info("p1"))
            assert await wait_until(lambda: watcher.get("p1") is not None) < 1.0
            await worker.deregister()
            assert await wait_until(lambda: watcher.get("p1") is None) < 1.0
            assert [r.info.worker_id for r in left] == ["p1"]
            await worker.aclose()
        keys = RegistryKeys(MODEL, prefix)
        with redis.Redis.from_url(redis_url) as client:
            assert client.exists(keys.worker("p1")) == 0
            assert client.smembers(keys.index) == set()

    run(scenario())


def test_silent_worker_expires_after_its_ttl_through_polling(redis_url: str, prefix: str) -> None:
    ttl_s = 1.0

    async def scenario() -> None:
        async with (
            RegistryWatcher(redis_url, MODEL, prefix=prefix, poll_interval_s=FAST_POLL_S) as w,
            WorkerRegistration(redis_url, prefix=prefix, ttl_s=ttl_s) as alive,
            WorkerRegistration(redis_url, prefix=prefix, ttl_s=ttl_s) as silent,
        ):
            await alive.register(make_info("alive"))
            beating = asyncio.create_task(
                alive.run_heartbeats(lambda: WorkerLoad(1, 0, 0, 0), interval_s=0.3)
            )
            registered_at = time.monotonic()  # before the entry (and its TTL) is written
            await silent.register(make_info("silent"))
            await wait_until(lambda: w.get("silent") is not None)
            await wait_until(lambda: w.get("silent") is None, timeout_s=ttl_s + 10.0)
            gone_after = time.monotonic() - registered_at
            # Not before the TTL ran out, and found by polling (expiry sends no notice). The
            # contract says TTL + poll (1.1 s); the bound is loose because a loaded machine
            # delays polls by seconds. A watcher that stopped polling never gets there.
            assert ttl_s * 0.9 < gone_after < ttl_s + 5.0
            await asyncio.sleep(ttl_s)  # well past the TTL: heartbeats keep "alive" in
            assert [r.info.worker_id for r in w.workers(WorkerRole.PREFILL)] == ["alive"]
            with redis.Redis.from_url(redis_url) as client:  # the watcher pruned the index
                assert client.smembers(RegistryKeys(MODEL, prefix).index) == {b"alive"}
            beating.cancel()

    run(scenario())


def test_models_do_not_see_each_other(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            RegistryWatcher(redis_url, "model-a", prefix=prefix) as watch_a,
            RegistryWatcher(redis_url, "model-b", prefix=prefix) as watch_b,
            WorkerRegistration(redis_url, prefix=prefix) as worker_a,
            WorkerRegistration(redis_url, prefix=prefix) as worker_b,
        ):
            await worker_a.register(make_info("a1", model="model-a"))
            await worker_b.register(make_info("b1", model="model-b"))
            await wait_until(lambda: watch_a.get("a1") is not None)
            await wait_until(lambda: watch_b.get("b1") is not None)
            await asyncio.sleep(0.6)  # more than one default poll
            assert [r.info.worker_id for r in watch_a.workers(WorkerRole.PREFILL)] == ["a1"]
            assert [r.info.worker_id for r in watch_b.workers(WorkerRole.PREFILL)] == ["b1"]

    run(scenario())


def test_watcher_started_later_sees_existing_workers(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            WorkerRegistration(redis_url, prefix=prefix) as prefill,
            WorkerRegistration(redis_url, prefix=prefix) as decode,
        ):
            await prefill.register(make_info("p1"))
            await decode.register(make_info("d1", WorkerRole.DECODE))
            joined: list[str] = []
            watcher = RegistryWatcher(
                redis_url, MODEL, prefix=prefix, on_join=lambda r: joined.append(r.info.worker_id)
            )
            await watcher.start()  # no waiting: the snapshot is filled when start returns
            assert [r.info.worker_id for r in watcher.workers(WorkerRole.PREFILL)] == ["p1"]
            assert [r.info.worker_id for r in watcher.workers(WorkerRole.DECODE)] == ["d1"]
            assert sorted(joined) == ["d1", "p1"]
            await watcher.stop()

    run(scenario())


def test_changed_info_counts_as_leave_then_join(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        events: list[tuple[str, str]] = []
        async with RegistryWatcher(
            redis_url,
            MODEL,
            prefix=prefix,
            on_join=lambda r: events.append(("join", r.info.address)),
            on_leave=lambda r: events.append(("leave", r.info.address)),
        ) as watcher:
            first = WorkerRegistration(redis_url, prefix=prefix)
            await first.register(make_info("p1", address="host:1"))
            await wait_until(lambda: watcher.get("p1") is not None)
            await first.aclose()  # "crashes" without deregistering; restarts on a new port
            async with WorkerRegistration(redis_url, prefix=prefix) as restarted:
                await restarted.register(make_info("p1", address="host:2"))
                await wait_until(lambda: watcher.get("p1").info.address == "host:2")
                assert events == [("join", "host:1"), ("leave", "host:1"), ("join", "host:2")]

    run(scenario())


def test_bad_entries_are_reported_once_and_do_not_stop_the_watcher(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = RegistryKeys(MODEL, prefix)
    wrong_version = json.loads(encode_record(WorkerRecord(make_info("v2"), WorkerLoad(1, 0, 0, 0))))
    wrong_version["schema_version"] = 2
    with redis.Redis.from_url(redis_url) as client:
        client.set(keys.worker("garbage"), b"{oops", px=20_000)
        client.set(keys.worker("v2"), json.dumps(wrong_version), px=20_000)
        client.sadd(keys.index, "garbage", "v2")

    async def scenario() -> None:
        def exploding_callback(record: WorkerRecord) -> None:
            raise RuntimeError("callback bug")

        async with (
            RegistryWatcher(
                redis_url,
                MODEL,
                prefix=prefix,
                poll_interval_s=FAST_POLL_S,
                on_join=exploding_callback,
            ) as watcher,
            WorkerRegistration(redis_url, prefix=prefix) as worker,
        ):
            await asyncio.sleep(5 * FAST_POLL_S)  # several polls re-read the bad entries
            assert watcher.workers(WorkerRole.PREFILL) == ()
            invalid = watcher.invalid_entries
            assert set(invalid) == {"garbage", "v2"}
            assert "unknown schema_version 2 (this build reads 1)" in str(invalid["v2"])
            await worker.register(make_info("good"))
            await wait_until(lambda: watcher.get("good") is not None)

    with caplog.at_level(logging.ERROR, logger="tandem.common.registry"):
        run(scenario())
    skipped = [r.getMessage() for r in caplog.records if "skipping worker" in r.getMessage()]
    assert len(skipped) == 2, skipped  # once per bad entry, not once per poll
    assert any("callback bug" in (r.exc_text or "") for r in caplog.records)


def test_watcher_and_worker_ride_out_a_redis_restart() -> None:
    """Redis restarts empty: the worker that heartbeats re-registers and never leaves the
    router's view; one that does not (dead meanwhile) leaves once the grace is over."""

    async def scenario(server: EmbeddedRedis) -> None:
        url = server.url
        left: list[str] = []
        async with (
            RegistryWatcher(
                url,
                MODEL,
                poll_interval_s=FAST_POLL_S,
                data_loss_grace_s=2.0,
                on_leave=lambda r: left.append(r.info.worker_id),
            ) as watcher,
            WorkerRegistration(url, ttl_s=1.0) as worker,
            WorkerRegistration(url, ttl_s=30.0) as silent,
        ):
            await worker.register(make_info("p1"))
            await silent.register(make_info("p2"))
            beating = asyncio.create_task(
                worker.run_heartbeats(lambda: WorkerLoad(5, 0, 0, 0), interval_s=0.2)
            )
            await wait_until(lambda: watcher.get("p1") is not None and watcher.get("p2"))
            server.stop()
            await asyncio.sleep(1.0)
            assert watcher.get("p1") is not None  # last snapshot kept while Redis is down
            server.start()  # same port, empty data: the heartbeat must re-create the entry
            restarted = time.monotonic()
            await wait_until(lambda: watcher.get("p1").load.free_kv_blocks == 5, timeout_s=10)
            gone = await wait_until(lambda: watcher.get("p2") is None, timeout_s=10.0)
            assert time.monotonic() - restarted >= 1.5  # not at the first empty read
            assert gone < 10 and left == ["p2"]  # p1 never left
            assert not beating.done()
            beating.cancel()

    with EmbeddedRedis() as first:
        fixed_port = EmbeddedRedis(first.binary, port=first.port)
    server = fixed_port.start()
    try:
        run(scenario(server))
    finally:
        server.stop()


def test_stop_always_returns_even_when_redis_py_swallows_a_cancel(
    redis_url: str, prefix: str
) -> None:
    async def scenario() -> None:
        for cycle in range(40):  # one cancel in ~20 used to be lost inside redis-py
            watcher = RegistryWatcher(redis_url, MODEL, prefix=prefix, poll_interval_s=0.001)
            await watcher.start()
            await asyncio.sleep(0.001 * (cycle % 8))
            await asyncio.wait_for(watcher.stop(), timeout=5.0)

    run(scenario())


def test_run_heartbeats_returns_after_deregister(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        worker = WorkerRegistration(redis_url, prefix=prefix, ttl_s=1.0)
        await worker.register(make_info("p1"))
        beating = asyncio.create_task(
            worker.run_heartbeats(lambda: WorkerLoad(1, 0, 0, 0), interval_s=0.01)
        )
        await asyncio.sleep(0.1)
        await worker.deregister()
        await asyncio.wait_for(beating, timeout=1.0)
        with redis.Redis.from_url(redis_url) as client:  # no late heartbeat re-created it
            assert client.exists(RegistryKeys(MODEL, prefix).worker("p1")) == 0
        await worker.aclose()

    run(scenario())
