"""The router side of the registry: a live, in-memory view of one model's workers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from types import TracebackType

from tandem.common.registry.records import (
    RegistryDecodeError,
    WorkerRecord,
    WorkerRole,
    decode_record,
)
from tandem.common.registry.redis_io import (
    DEFAULT_PREFIX,
    REDIS_ERRORS,
    FailureLog,
    RegistryKeys,
    connect,
)

DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_DATA_LOSS_GRACE_S = 5.0
"""After Redis lost its data (a restart without persistence, a flush), how long the
last snapshot is kept while workers re-register: a heartbeat and a TTL, with slack."""

# How long start() waits for the notice subscription before returning anyway.
_SUBSCRIBE_WAIT_S = 2.0

_log = logging.getLogger(__name__)

WorkerCallback = Callable[[WorkerRecord], None]


class RegistryWatcher:
    """The router's live snapshot of one model's workers.

    The snapshot is re-read every ``poll_interval_s`` and at once when a join/leave
    notice arrives. A worker is in it while its entry exists: it leaves at once after
    ``deregister`` and at most TTL + ``poll_interval_s`` (+ one Redis round trip) after
    its last heartbeat. On Redis errors the last snapshot is kept and reading is retried.
    Entries that cannot be decoded are left out, logged once per distinct error and
    listed in ``invalid_entries``. If Redis comes back empty (restarted without
    persistence, flushed; told by a sentinel key going missing), the workers last seen
    stay for ``data_loss_grace_s`` while they re-register with their next heartbeat,
    rather than all leaving at once.

    ``on_join(record)`` runs when a worker appears and ``on_leave(record)`` (with its
    last known record) when it disappears; a worker whose ``WorkerInfo`` changed (for
    example restarted on another port) leaves and joins again. Callbacks run on the
    event loop right after the snapshot changes, must not block, and their exceptions
    are logged, not raised. Load-only changes fire no callback.
    """

    def __init__(
        self,
        redis_url: str,
        model: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        on_join: WorkerCallback | None = None,
        on_leave: WorkerCallback | None = None,
        data_loss_grace_s: float = DEFAULT_DATA_LOSS_GRACE_S,
    ):
        self._client = connect(redis_url)
        self._data_loss_grace_s = data_loss_grace_s
        self._kept_until = 0.0
        self._sentinel_seen = False
        self._keys = RegistryKeys(model, prefix)
        self._poll_interval_s = poll_interval_s
        self._on_join = on_join
        self._on_leave = on_leave
        self._workers: dict[str, WorkerRecord] = {}
        self._by_role: dict[WorkerRole, tuple[WorkerRecord, ...]] = {}
        self._invalid: dict[str, RegistryDecodeError] = {}
        self._read_failures = FailureLog(f"registry read for {model!r}")
        self._wake = asyncio.Event()
        self._subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def workers(self, role: WorkerRole) -> tuple[WorkerRecord, ...]:
        """Live workers of ``role``, ordered by worker id. O(1): a prebuilt tuple."""
        return self._by_role.get(role, ())

    def get(self, worker_id: str) -> WorkerRecord | None:
        """The live worker ``worker_id``, or ``None`` if it is not in the snapshot."""
        return self._workers.get(worker_id)

    @property
    def invalid_entries(self) -> Mapping[str, RegistryDecodeError]:
        """Worker ids whose entry could not be decoded at the last successful read."""
        return dict(self._invalid)

    async def start(self) -> None:
        """Read the registry once, then keep watching in background tasks.

        Returns after that first read and once subscribed to notices, or after a short
        wait if Redis is unreachable (the watcher then keeps retrying in the background).
        """
        if self._tasks:
            raise RuntimeError("watcher already started")
        await self._refresh_logged()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="registry-poll"),
            asyncio.create_task(self._notice_loop(), name="registry-notices"),
        ]
        await _wait_for_event(self._subscribed, _SUBSCRIBE_WAIT_S)

    async def stop(self) -> None:
        """Stop watching and close the Redis connection; the snapshot stays readable."""
        await _cancel_and_wait(self._tasks)
        self._tasks = []
        await self._client.aclose()

    async def __aenter__(self) -> RegistryWatcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _poll_loop(self) -> None:
        while True:
            await _wait_for_event(self._wake, self._poll_interval_s)
            self._wake.clear()
            await self._refresh_logged()

    async def _notice_loop(self) -> None:
        failures = FailureLog(f"registry notices for {self._keys.model!r}")
        while True:
            try:
                await self._listen_for_notices(failures)
            except REDIS_ERRORS as err:
                failures.failed(err)
            self._subscribed.clear()
            await asyncio.sleep(self._poll_interval_s)

    async def _listen_for_notices(self, failures: FailureLog) -> None:
        """Wake the poll loop on every notice; returns or raises when the link breaks."""
        async with self._client.pubsub() as pubsub:
            await pubsub.subscribe(self._keys.events)
            failures.succeeded()
            self._subscribed.set()
            self._wake.set()  # catch up on anything missed while not subscribed
            async for _message in pubsub.listen():
                self._wake.set()

    async def _refresh_logged(self) -> None:
        try:
            await self._refresh()
            self._read_failures.succeeded()
        except REDIS_ERRORS as err:
            self._read_failures.failed(err)

    async def _refresh(self) -> None:
        """Re-read every indexed entry, swap the snapshot, then prune expired ids."""
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.smembers(self._keys.index)
            pipe.set(self._keys.sentinel, b"1", nx=True)
            raw_ids, created = await pipe.execute()
        now = asyncio.get_running_loop().time()
        if created and self._sentinel_seen and self._workers:
            self._kept_until = now + self._data_loss_grace_s
            _log.warning(
                "the registry in Redis is empty (Redis restarted or was flushed): keeping "
                "the %d workers last seen for %.0f s while they re-register",
                len(self._workers),
                self._data_loss_grace_s,
            )
        self._sentinel_seen = True
        ids = sorted(raw.decode("utf-8", "backslashreplace") for raw in raw_ids)
        raws = await self._client.mget([self._keys.worker(i) for i in ids]) if ids else []
        entries = dict(zip(ids, raws, strict=True))
        live: dict[str, WorkerRecord] = {}
        invalid: dict[str, RegistryDecodeError] = {}
        for worker_id, raw in entries.items():
            if raw is None:
                continue
            try:
                live[worker_id] = self._decode(worker_id, raw)
            except RegistryDecodeError as err:
                invalid[worker_id] = err
        self._report_invalid(invalid)
        if now < self._kept_until:
            live = {**self._workers, **live}
        self._apply(live)
        expired = [worker_id for worker_id, raw in entries.items() if raw is None]
        if expired:
            await self._client.srem(self._keys.index, *expired)

    def _decode(self, worker_id: str, raw: bytes) -> WorkerRecord:
        key = self._keys.worker(worker_id)
        record = decode_record(raw, key)
        if (record.info.worker_id, record.info.model) != (worker_id, self._keys.model):
            reason = f"holds worker {record.info.worker_id!r} of model {record.info.model!r}"
            raise RegistryDecodeError(key, reason)
        return record

    def _report_invalid(self, invalid: dict[str, RegistryDecodeError]) -> None:
        for worker_id, err in invalid.items():
            previous = self._invalid.get(worker_id)
            if previous is None or str(previous) != str(err):
                _log.error("skipping worker %r: %s", worker_id, err)
        self._invalid = invalid

    def _apply(self, live: dict[str, WorkerRecord]) -> None:
        """Swap in the new snapshot, then fire leave and join callbacks for the diff."""
        old, self._workers = self._workers, live
        self._by_role = {
            role: tuple(r for r in live.values() if r.info.role is role) for role in WorkerRole
        }
        for worker_id, record in old.items():
            if worker_id not in live or live[worker_id].info != record.info:
                _log.info("worker %r at %s left", worker_id, record.info.address)
                self._call(self._on_leave, record)
        for worker_id, record in live.items():
            if worker_id not in old or old[worker_id].info != record.info:
                _log.info("worker %r at %s joined", worker_id, record.info.address)
                self._call(self._on_join, record)

    def _call(self, callback: WorkerCallback | None, record: WorkerRecord) -> None:
        if callback is None:
            return
        try:
            callback(record)
        except Exception:
            _log.exception("registry callback failed for worker %r", record.info.worker_id)


async def _wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """Return once ``event`` is set or ``timeout_s`` has passed, whichever is first.

    Not ``asyncio.wait_for(event.wait(), ...)``: on Python < 3.12 that swallows a
    cancellation arriving just as the event is set, and the task then never stops.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until all are done, cancelling again if one lives on.

    redis-py's asyncio client can swallow a cancellation that lands inside a command
    (it uses ``asyncio.wait_for`` for socket writes; redis/redis-py#2028 and #2551 are
    the same family), so one ``cancel()`` does not reliably stop a Redis loop.
    """
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.05)
