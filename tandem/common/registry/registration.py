"""The worker side of the registry: one worker's own entry and its heartbeats."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType

from tandem.common.registry.records import WorkerInfo, WorkerLoad, WorkerRecord, encode_record
from tandem.common.registry.redis_io import (
    DEFAULT_PREFIX,
    REDIS_ERRORS,
    FailureLog,
    RegistryEvent,
    RegistryKeys,
    connect,
    encode_notice,
)

DEFAULT_TTL_S = 3.0
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0

_log = logging.getLogger(__name__)


class NotRegisteredError(RuntimeError):
    """A heartbeat from a ``WorkerRegistration`` that is not (or no longer) registered."""


class WorkerRegistration:
    """One worker's own registry entry.

    Lifecycle: ``register(info)`` once, then ``heartbeat(load)`` more often than every
    ``ttl_s`` (usually through ``run_heartbeats``), then ``deregister()``. Heartbeats
    and ``deregister`` are serialized, so no heartbeat can re-create the entry once
    ``deregister`` has started, and ``run_heartbeats`` then returns by itself. Owns its
    Redis connection: ``aclose()`` it, or use ``async with`` (which also deregisters).
    """

    def __init__(
        self, redis_url: str, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = DEFAULT_TTL_S
    ):
        if ttl_s < 0.001:
            raise ValueError(f"ttl_s must be >= 0.001 (Redis TTLs are in ms), got {ttl_s}")
        self._client = connect(redis_url)
        self._prefix = prefix
        self._ttl_ms = round(ttl_s * 1000)
        self._info: WorkerInfo | None = None
        self._writing = asyncio.Lock()  # one write at a time: deregister waits for a heartbeat

    @property
    def info(self) -> WorkerInfo | None:
        """The registered worker, or ``None`` before ``register`` / after ``deregister``."""
        return self._info

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> None:
        """Write the entry (``load=None``: an idle load) and announce the join."""
        if load is None:
            load = WorkerLoad.idle(info.capacity)
        async with self._writing:
            if self._info is not None:
                raise RuntimeError(f"already registered as {self._info.worker_id!r}")
            await self._write(info, load, RegistryEvent.JOINED)
            self._info = info

    async def heartbeat(self, load: WorkerLoad) -> None:
        """Rewrite the entry with ``load`` and restart its TTL (re-creating it if expired)."""
        async with self._writing:
            if self._info is None:
                raise NotRegisteredError("heartbeat() before register() or after deregister()")
            await self._write(self._info, load, event=None)

    async def run_heartbeats(
        self,
        load_fn: Callable[[], WorkerLoad],
        interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> None:
        """Send ``heartbeat(load_fn())`` every ``interval_s`` until deregistered or cancelled.

        Must be called after ``register``; ``interval_s`` must be shorter than the TTL.
        Redis errors are logged and retried at the next tick (the entry expires if they
        outlast the TTL and comes back with the first heartbeat that succeeds); errors
        raised by ``load_fn`` propagate. Returns once ``deregister`` has been called,
        which stops it even where redis-py swallowed a cancellation.
        """
        if not 0 < interval_s * 1000 < self._ttl_ms:
            raise ValueError(f"interval_s={interval_s} must be in (0, ttl_s)")
        if self._info is None:
            raise NotRegisteredError("run_heartbeats() before register()")
        failures = FailureLog("registry heartbeat")
        while True:
            load = load_fn()
            try:
                await self.heartbeat(load)
                failures.succeeded()
            except NotRegisteredError:
                return
            except REDIS_ERRORS as err:
                failures.failed(err)
            await asyncio.sleep(interval_s)

    async def deregister(self) -> None:
        """Delete the entry now and announce the leave; a no-op when not registered.

        The registration counts as gone even if Redis fails here (the error propagates
        and the entry then expires on its own).
        """
        async with self._writing:
            info, self._info = self._info, None
            if info is None:
                return
            keys = RegistryKeys(info.model, self._prefix)
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(keys.worker(info.worker_id))
                pipe.srem(keys.index, info.worker_id)
                pipe.publish(keys.events, encode_notice(RegistryEvent.LEFT, info.worker_id))
                await pipe.execute()

    async def aclose(self) -> None:
        """Close the Redis connection (does not deregister)."""
        await self._client.aclose()

    async def __aenter__(self) -> WorkerRegistration:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.deregister()
        except REDIS_ERRORS as err:
            _log.warning("deregister failed; the entry will expire instead: %r", err)
        finally:
            await self.aclose()

    async def _write(self, info: WorkerInfo, load: WorkerLoad, event: RegistryEvent | None) -> None:
        """Set the entry with its TTL and index it (and publish ``event``), atomically."""
        keys = RegistryKeys(info.model, self._prefix)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(
                keys.worker(info.worker_id),
                encode_record(WorkerRecord(info, load)),
                px=self._ttl_ms,
            )
            pipe.sadd(keys.index, info.worker_id)
            if event is not None:
                pipe.publish(keys.events, encode_notice(event, info.worker_id))
            await pipe.execute()
