"""Load rebalancing across decode workers by live migration.

Routing places a stream once, on the load it saw then; streams then live for minutes
and grow, so one decode worker's KV pool can fill (and its steps slow) while a peer's
sits half empty. Every ``interval_s`` the rebalancer reads the decode pool's loads
(from the registry's heartbeats): a worker's *usage* is the larger of its KV pool's
share held by requests and its running sequences' share of ``max_num_seqs`` (what makes
its steps slow: the batch it computes). When the fullest worker's usage exceeds the
emptiest's by at least ``gap`` and is itself at least ``min_usage``, it is asked to hand
over enough streams to close half the gap (``Migrate`` with ``num_blocks`` and
``num_streams``): the worker picks its largest streams, and the router sends each to the
decode policy's choice, which pulls its KV there.

Hysteresis, so streams do not bounce: after a move the rebalancer stays disarmed until
the gap has fallen below ``gap / 2`` or ``cooldown_s`` has passed, and a worker that
just gave or took streams is not a source again within ``cooldown_s``.

Torch-free. ``plan`` decides on a snapshot (pure, tested alone); ``run`` acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tandem.common.registry import RegistryWatcher, WorkerRecord, WorkerRole
from tandem.protos import worker_pb2
from tandem.router.clients import WorkerClients

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceConfig:
    interval_s: float = 0.0
    """How often the loads are compared (0: rebalancing off)."""
    gap: float = 0.25
    """KV usage difference (fullest minus emptiest, as fractions of their pools) that
    triggers a move."""
    min_usage: float = 0.5
    """The fullest worker's usage must also be at least this: below it nobody is short."""
    cooldown_s: float = 10.0
    """A worker that gave or took streams is not a source again for this long."""

    def __post_init__(self) -> None:
        if self.interval_s < 0:
            raise ValueError(f"the rebalance interval must be >= 0, got {self.interval_s}")
        if not 0 < self.gap <= 1:
            raise ValueError(f"the rebalance gap must be in (0, 1], got {self.gap}")
        if not 0 <= self.min_usage <= 1:
            raise ValueError(f"the rebalance minimum usage must be in [0, 1], got {self.min_usage}")

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0


@dataclass(frozen=True)
class Move:
    """Ask ``source`` to hand over streams holding ``num_blocks`` KV blocks, and at least
    ``num_streams`` of them."""

    source: str
    num_blocks: int
    num_streams: int
    gap: float
    """The usage gap that triggered it (for the log)."""


def kv_usage(record: WorkerRecord) -> float:
    """The share of the worker's KV pool that requests hold."""
    total = record.info.capacity.num_kv_blocks
    return (total - record.load.free_kv_blocks) / total if total else 0.0


def batch_usage(record: WorkerRecord) -> float:
    """Its running sequences' share of the most it batches."""
    most = record.info.capacity.max_num_seqs
    return record.load.num_running_seqs / most if most else 0.0


def usage(record: WorkerRecord) -> float:
    """How full the worker is: its KV pool or its batch, whichever is fuller."""
    return max(kv_usage(record), batch_usage(record))


class Rebalancer:
    def __init__(
        self, watcher: RegistryWatcher, clients: WorkerClients, config: RebalanceConfig
    ) -> None:
        self.watcher = watcher
        self.clients = clients
        self.config = config
        self.num_moves = 0
        """Moves asked for so far (each a ``Migrate`` call that moved something)."""
        self._armed = True
        self._disarmed_at = 0.0
        self._cooling: dict[str, float] = {}  # worker id -> when it last gave or took

    def plan(self, workers: Sequence[WorkerRecord], now: float) -> Move | None:
        """The move to make on this snapshot, if any; updates the hysteresis state."""
        c = self.config
        if len(workers) < 2:
            return None
        ranked = sorted(workers, key=usage)
        cold, hot = ranked[0], ranked[-1]
        gap = usage(hot) - usage(cold)
        if not self._armed:
            if gap < c.gap / 2 or now - self._disarmed_at >= c.cooldown_s:
                self._armed = True
            else:
                return None
        if gap < c.gap or usage(hot) < c.min_usage:
            return None
        if now - self._cooling.get(hot.info.worker_id, -c.cooldown_s) < c.cooldown_s:
            return None
        # Half of each gap, in its own unit: blocks of KV, sequences of batch.
        kv_gap = kv_usage(hot) - kv_usage(cold)
        batch_gap = batch_usage(hot) - batch_usage(cold)
        num_blocks = max(0, int(kv_gap / 2 * hot.info.capacity.num_kv_blocks))
        num_streams = max(0, int(batch_gap / 2 * hot.info.capacity.max_num_seqs))
        if not num_blocks and not num_streams:
            num_streams = 1
        return Move(hot.info.worker_id, num_blocks, num_streams, gap)

    def moved(self, move: Move, workers: Sequence[WorkerRecord], now: float) -> None:
        """Record that ``move`` happened: disarm, and cool the source and the emptiest."""
        self._armed = False
        self._disarmed_at = now
        self._cooling[move.source] = now
        cold = min(workers, key=usage)
        self._cooling[cold.info.worker_id] = now
        self.num_moves += 1

    async def run(self) -> None:
        """Until cancelled: compare the loads every ``interval_s`` and move streams."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.step()

    async def step(self) -> worker_pb2.MigrateResponse | None:
        """One comparison, and the move it calls for (``None`` when none was made)."""
        workers = self.watcher.workers(WorkerRole.DECODE)
        now = time.monotonic()
        move = self.plan(workers, now)
        if move is None:
            return None
        record = self.watcher.get(move.source)
        if record is None:
            return None
        response = await self.clients.decode(record).Migrate(
            worker_pb2.MigrateRequest(
                num_blocks=move.num_blocks,
                num_streams=move.num_streams,
                cause=worker_pb2.MIGRATION_CAUSE_REBALANCE,
            ),
            timeout=10.0,
        )
        if response.request_ids:
            self.moved(move, workers, now)
            log.info(
                "rebalance: %s is %.0f%% fuller than the emptiest decode worker; moved %d "
                "streams (%d KV blocks) off it",
                move.source,
                100 * move.gap,
                len(response.request_ids),
                response.num_blocks,
            )
        return response
