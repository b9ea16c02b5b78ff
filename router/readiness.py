"""When the router may take traffic: its readiness rule, kept in step with the registry.

A router that cannot route must say so before a load balancer or a Kubernetes probe
sends it requests: it is ready while the registry holds at least ``min_decode_workers``
decode workers and ``min_prefill_workers`` prefill workers of its model, and not ready
before its first registry read or when it loses them. Readiness is the health status
of the router's gRPC server (``RunningServer.set_serving``); liveness is separate and
stays ``SERVING`` while the process runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.common.registry import WorkerRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadinessRule:
    min_decode_workers: int = 1
    """At least 1: without a decode worker nothing can be served."""
    min_prefill_workers: int = 0
    """0: decode workers prefill prompts themselves when no prefill worker is left."""

    def __post_init__(self) -> None:
        if self.min_decode_workers < 1:
            raise ValueError(f"min_decode_workers must be >= 1, got {self.min_decode_workers}")
        if self.min_prefill_workers < 0:
            raise ValueError(f"min_prefill_workers must be >= 0, got {self.min_prefill_workers}")

    def unmet(self, num_prefill: int, num_decode: int) -> str | None:
        """Why the router is not ready with these worker counts; ``None``: it is."""
        if num_decode < self.min_decode_workers:
            return f"{num_decode} of {self.min_decode_workers} decode workers registered"
        if num_prefill < self.min_prefill_workers:
            return f"{num_prefill} of {self.min_prefill_workers} prefill workers registered"
        return None


SetReady = Callable[[bool], Awaitable[None]]


class ReadinessTracker:
    """Re-evaluates the rule whenever the registry's membership changes and reports
    transitions, in order, to the health status ``attach`` hands it.

    ``update`` is cheap and synchronous: the registry watcher's join/leave callbacks call
    it (from the first registry read on, which comes before the server exists); it
    schedules the (async) health update only when readiness changes.
    """

    def __init__(self, rule: ReadinessRule, count: Callable[[WorkerRole], int]) -> None:
        self.rule = rule
        self._count = count
        self._set_ready: SetReady | None = None
        self.ready = False
        self._pending: asyncio.Task[None] | None = None

    async def attach(self, set_ready: SetReady) -> None:
        """Report to ``set_ready`` from now on, starting with the current readiness."""
        self._set_ready = set_ready
        await set_ready(self.ready)

    def update(self) -> None:
        reason = self.rule.unmet(self._count(WorkerRole.PREFILL), self._count(WorkerRole.DECODE))
        ready = reason is None
        if ready == self.ready:
            return
        self.ready = ready
        if ready:
            log.info("router ready: it can route")
        else:
            log.warning("router not ready: %s", reason)
        if self._set_ready is not None:
            self._chain(self._set_ready, ready)

    async def settled(self) -> None:
        """Wait until the health status reflects the last ``update``."""
        if self._pending is not None:
            await self._pending

    def _chain(self, set_ready: SetReady, ready: bool) -> None:
        previous = self._pending

        async def apply() -> None:
            if previous is not None:
                await previous
            await set_ready(ready)

        self._pending = asyncio.get_running_loop().create_task(apply())
