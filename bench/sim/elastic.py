"""An elastic fleet on a discrete-event clock: requests from a trace through simulated
prefill and decode replicas that a scaling policy adds and drains while it runs.

* **Replicas** are the fleet simulator's workers (``tandem.bench.sim.workers``: FIFO
  chunked prefill, continuous-batching decode, step times from ``Calibration``) with a
  lifecycle: asked for -> ``STARTING`` for ``startup_s`` -> ``SERVING`` -> ``DRAINING``
  (no new requests; it finishes those it holds) -> ``STOPPED``. A replica counts
  replica-seconds from the moment it is asked for until it stops; one asked away while
  still starting stops at once. Scaling down takes the newest replicas first, as the
  actuators do (``LocalCluster.scale`` retires the newest).
* **Routing** (simulated): a new request goes to the serving prefill replica with the
  fewest queued prompt tokens, then to the serving decode replica holding the fewest
  sequences; with none serving it waits at the router for the first that starts.
* **Metrics**: the router and every serving replica expose what the real ones do
  (``tandem.bench.sim.exposition``); a policy reads them through ``scrape``, every
  ``interval_s`` of its own, and sets each pool's replica count.
* **Outcomes**: per request, TTFT (arrival to first token, i.e. the end of its prefill)
  and TPOT (first token to last over the tokens after the first, as the router's
  histogram has it; KV pull and any wait for a decode slot included).

Replica-hours are counted over the trace (``[0, end_s]``); the requests still running at
the end are finished, outside the count, so every arrival is finished exactly once.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from tandem.bench.sim.capacity import ReplicaModel
from tandem.bench.sim.exposition import RouterMetrics, WorkerReading, worker_scrape
from tandem.bench.sim.trace import Arrivals
from tandem.bench.sim.workers import Job, SimDecodeWorker, SimPrefillWorker
from tandem.common.kv_events.events import KVCacheEvent
from tandem.common.metrics import Scrape
from tandem.common.registry import WorkerCapacity

POOLS = ("prefill", "decode")
DECODE_KV_BLOCKS = 1 << 22
"""KV memory is not modelled as a limit: a decode replica is bounded by ``max_num_seqs``."""


class ReplicaState(Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_LIVE = (ReplicaState.STARTING, ReplicaState.SERVING)
"""The states a replica is counted in: set, not yet asked away."""


@dataclass(eq=False)
class Replica:
    name: str
    pool: str
    worker: SimPrefillWorker | SimDecodeWorker
    """A ``SimPrefillWorker`` in the prefill pool, a ``SimDecodeWorker`` in the decode one."""
    asked_at: float
    state: ReplicaState = ReplicaState.STARTING
    stopped_at: float | None = None
    prompt_tokens: int = 0
    """Prompt tokens of the requests it received (its ``prompt_tokens_total``)."""
    prefilled_tokens: int = 0
    """Prompt tokens of the prefills it finished (its ``prefix_cache_queries_total``)."""
    decode_busy_s: float = 0.0
    """Decode: closed stepping periods (a prefill worker counts its own busy time)."""
    stepping_since: float | None = None

    def seconds_until(self, end_s: float) -> float:
        """Replica-seconds over ``[0, end_s]``."""
        stop = end_s if self.stopped_at is None else min(self.stopped_at, end_s)
        return max(0.0, stop - self.asked_at)

    @property
    def idle(self) -> bool:
        w = self.worker
        if isinstance(w, SimPrefillWorker):
            return not w.queue and not w.busy
        return not (w.active or w.joining or w.waiting or w.num_pulling)


@dataclass(frozen=True)
class FleetConfig:
    model: ReplicaModel
    startup_s: float
    """From the moment a replica is asked for to the moment it serves."""
    ttft_slo_s: float
    tpot_slo_s: float

    def __post_init__(self) -> None:
        if self.startup_s < 0:
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class FleetScrape:
    """One round of scrapes: the router's and each serving replica's, by name."""

    at_s: float
    router: Scrape
    prefill: Mapping[str, Scrape]
    decode: Mapping[str, Scrape]


class Scaler(Protocol):
    """A scaling policy. ``interval_s``: how often ``decide`` is called (``None``: never,
    the fleet stays as it started)."""

    name: str
    interval_s: float | None

    def decide(
        self, now: float, scrape: FleetScrape, replicas: Mapping[str, int]
    ) -> Mapping[str, int]:
        """The replica count wanted per pool, given this round's scrapes and the counts
        set now (starting and serving replicas; draining ones are gone)."""
        ...


@dataclass(frozen=True)
class FleetResult:
    policy: str
    requests: int
    finished: int
    """Requests finished at least once."""
    finished_twice: int
    """Requests finished more than once (a bug if ever > 0)."""
    slo_met: int
    ttft_met: int
    tpot_met: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    replica_hours: dict[str, float]
    peak_replicas: dict[str, int]
    scale_events: dict[str, int]
    simulated_s: float
    wall_s: float
    timeline: list[tuple[float, str, int, int]] = field(repr=False, default_factory=list)
    """(time, pool, replicas set, replicas serving) at every change of either."""

    @property
    def slo_attainment(self) -> float:
        return self.slo_met / self.requests if self.requests else 1.0

    @property
    def total_replica_hours(self) -> float:
        return sum(self.replica_hours.values())


class ElasticFleet:
    """The simulation; also the workers' ``Host`` and the policies' actuator."""

    def __init__(self, config: FleetConfig, initial: Mapping[str, int]) -> None:
        """``initial``: replicas per pool, serving from time 0."""
        self.config = config
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._order = itertools.count()
        self.router = RouterMetrics()
        self._all: dict[str, list[Replica]] = {pool: [] for pool in POOLS}
        self._serving: dict[str, list[Replica]] = {pool: [] for pool in POOLS}
        self._by_worker: dict[str, Replica] = {}
        self._waiting: dict[str, deque[Job]] = {pool: deque() for pool in POOLS}
        self._scale_events = {pool: 0 for pool in POOLS}
        self._timeline: list[tuple[float, str, int, int]] = []
        # Per request of the run, by arrival index (set by ``run``).
        self._at: list[float] = []
        self._prompt: list[int] = []
        self._output: list[int] = []
        self._ttft = np.zeros(0)
        self._tpot = np.zeros(0)
        self._finished = np.zeros(0, dtype=np.int32)
        for pool in POOLS:
            for _ in range(initial.get(pool, 0)):
                self._add(pool, serving=True)
            self._note(pool)

    # --- the clock and the workers' Host ----------------------------------------------

    def after(self, delay: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._order), fn, args))

    def load_changed(self, worker: SimPrefillWorker | SimDecodeWorker) -> None:
        replica = self._by_worker[worker.worker_id]
        if isinstance(worker, SimDecodeWorker):
            stepping = bool(worker.active)
            if stepping and replica.stepping_since is None:
                replica.stepping_since = self.now
            elif not stepping and replica.stepping_since is not None:
                replica.decode_busy_s += self.now - replica.stepping_since
                replica.stepping_since = None
        if replica.state is ReplicaState.DRAINING and replica.idle:
            self._stop(replica)

    def publish(self, worker_id: str, events: list[KVCacheEvent]) -> None:
        """No KV index listens here (prompts share nothing)."""

    def prefilled(self, job: Job, worker: SimPrefillWorker) -> None:
        self._by_worker[worker.worker_id].prefilled_tokens += job.num_tokens
        job.first_token_at = self.now
        ttft = self.now - job.arrived
        self._ttft[job.rid] = ttft
        self.router.first_token(ttft)
        self._to_decode(job)

    def decoded(self, job: Job) -> None:
        tpot = None
        if job.max_tokens > 1:
            tpot = (self.now - job.first_token_at) / (job.max_tokens - 1)
            self._tpot[job.rid] = tpot
        self._finished[job.rid] += 1
        self.router.finished(job.max_tokens, tpot, self.now - job.arrived)

    # --- the actuator ------------------------------------------------------------------

    def replicas(self, pool: str) -> int:
        """Replicas set: starting and serving (draining ones no longer count)."""
        return sum(r.state in _LIVE for r in self._all[pool])

    def scale(self, pool: str, replicas: int) -> None:
        """Ask for ``replicas``: new ones start; the newest go (starting ones stop at
        once, serving ones drain)."""
        live = [r for r in self._all[pool] if r.state in _LIVE]
        if replicas == len(live):
            return
        self._scale_events[pool] += 1
        for _ in range(replicas - len(live)):
            self._add(pool, serving=False)
        for replica in reversed(live[max(0, replicas) :]):
            if replica.state is ReplicaState.STARTING:
                self._stop(replica)
            else:
                self._drain(replica)
        self._note(pool)

    def scrape(self) -> FleetScrape:
        return FleetScrape(
            self.now,
            self.router.scrape(),
            {r.name: worker_scrape(self._reading(r)) for r in self._serving["prefill"]},
            {r.name: worker_scrape(self._reading(r)) for r in self._serving["decode"]},
        )

    # --- a run -------------------------------------------------------------------------

    def run(self, arrivals: Arrivals, scaler: Scaler, end_s: float) -> FleetResult:
        """Replay ``arrivals`` under ``scaler`` (asked every ``interval_s`` up to
        ``end_s``), until every request has finished. Call once per fleet."""
        started = time.perf_counter()
        n = len(arrivals)
        self._at = arrivals.at_s.tolist()
        self._prompt = arrivals.prompt_tokens.tolist()
        self._output = arrivals.output_tokens.tolist()
        self._ttft = np.full(n, np.nan)
        self._tpot = np.full(n, np.nan)
        self._finished = np.zeros(n, dtype=np.int32)
        if n:
            self.after(self._at[0], self._arrive, 0)
        if scaler.interval_s is not None:
            self.after(0.0, self._tick, scaler, end_s)
        events = self._events
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            while events:
                self.now, _, fn, args = heapq.heappop(events)
                fn(*args)
        finally:
            if gc_was_enabled:
                gc.enable()
        return self._result(scaler.name, end_s, time.perf_counter() - started)

    def _arrive(self, i: int) -> None:
        job = Job(i, (), self._prompt[i], self._output[i], self.now, measured=True)
        self.router.arrived(job.num_tokens)
        self._to_prefill(job)
        if i + 1 < len(self._at):
            self.after(self._at[i + 1] - self.now, self._arrive, i + 1)

    def _tick(self, scaler: Scaler, end_s: float) -> None:
        counts = {pool: self.replicas(pool) for pool in POOLS}
        targets = scaler.decide(self.now, self.scrape(), counts)
        for pool, target in targets.items():
            self.scale(pool, target)
        assert scaler.interval_s is not None
        if self.now + scaler.interval_s <= end_s:
            self.after(scaler.interval_s, self._tick, scaler, end_s)

    # --- routing -----------------------------------------------------------------------

    def _to_prefill(self, job: Job) -> None:
        serving = self._serving["prefill"]
        if not serving:
            self._waiting["prefill"].append(job)
            return
        replica = min(serving, key=_queued_tokens)
        replica.prompt_tokens += job.num_tokens
        worker = replica.worker
        assert isinstance(worker, SimPrefillWorker)
        worker.enqueue(job, 0)

    def _to_decode(self, job: Job) -> None:
        serving = self._serving["decode"]
        if not serving:
            self._waiting["decode"].append(job)
            return
        replica = min(serving, key=_sequences)
        worker = replica.worker
        assert isinstance(worker, SimDecodeWorker)
        worker.admit(job)

    # --- replicas ----------------------------------------------------------------------

    def _add(self, pool: str, serving: bool) -> None:
        cal, name = self.config.model.calibration, f"{pool}-{len(self._all[pool])}"
        if pool == "prefill":
            capacity = WorkerCapacity(1, cal.block_size, self.config.model.max_num_seqs)
            worker: SimPrefillWorker | SimDecodeWorker = SimPrefillWorker(
                self, name, capacity, cal, report=False
            )
        else:
            capacity = WorkerCapacity(
                DECODE_KV_BLOCKS, cal.block_size, self.config.model.max_num_seqs
            )
            worker = SimDecodeWorker(self, name, capacity, cal, report=False)
        replica = Replica(name, pool, worker, self.now)
        self._all[pool].append(replica)
        self._by_worker[name] = replica
        if serving:
            self._serve(replica)
        else:
            self.after(self.config.startup_s, self._started, replica)

    def _started(self, replica: Replica) -> None:
        if replica.state is ReplicaState.STARTING:  # not asked away meanwhile
            self._serve(replica)
            self._note(replica.pool)

    def _serve(self, replica: Replica) -> None:
        replica.state = ReplicaState.SERVING
        self._serving[replica.pool].append(replica)
        waiting = self._waiting[replica.pool]
        send = self._to_prefill if replica.pool == "prefill" else self._to_decode
        while waiting:
            send(waiting.popleft())

    def _drain(self, replica: Replica) -> None:
        replica.state = ReplicaState.DRAINING
        self._serving[replica.pool].remove(replica)
        if replica.idle:
            self._stop(replica)

    def _stop(self, replica: Replica) -> None:
        if replica.state is ReplicaState.SERVING:
            self._serving[replica.pool].remove(replica)
        if replica.stepping_since is not None:
            replica.decode_busy_s += self.now - replica.stepping_since
            replica.stepping_since = None
        replica.state = ReplicaState.STOPPED
        replica.stopped_at = self.now
        self._note(replica.pool)

    def _note(self, pool: str) -> None:
        entry = (self.now, pool, self.replicas(pool), len(self._serving[pool]))
        if not self._timeline or self._timeline[-1][1:] != entry[1:]:
            self._timeline.append(entry)

    def _reading(self, r: Replica) -> WorkerReading:
        w = r.worker
        if isinstance(w, SimPrefillWorker):
            admitted = sum(job.admitted for job in w.queue)
            return WorkerReading(
                "prefill", r.prompt_tokens, r.prefilled_tokens, 0, w.busy_seconds, admitted,
                len(w.queue) - admitted, 0, w.queued_tokens, 0.0,
            )  # fmt: skip
        busy = r.decode_busy_s
        if r.stepping_since is not None:
            busy += self.now - r.stepping_since
        return WorkerReading(
            "decode", 0, 0, w.tokens_generated(), busy, len(w.active) + len(w.joining),
            len(w.waiting), w.num_pulling, 0, w.held_blocks / w.info.capacity.num_kv_blocks,
        )  # fmt: skip

    # --- figures -----------------------------------------------------------------------

    def _result(self, policy: str, end_s: float, wall_s: float) -> FleetResult:
        c = self.config
        ttft_ok = self._ttft <= c.ttft_slo_s
        # A one-token answer has no TPOT: it meets the TPOT target by definition.
        tpot_ok = np.isnan(self._tpot) | (self._tpot <= c.tpot_slo_s)
        done = self._finished > 0
        tpot_ok &= done
        hours = {
            pool: sum(r.seconds_until(end_s) for r in self._all[pool]) / 3600 for pool in POOLS
        }
        return FleetResult(
            policy=policy,
            requests=len(self._ttft),
            finished=int(done.sum()),
            finished_twice=int((self._finished > 1).sum()),
            slo_met=int((ttft_ok & tpot_ok).sum()),
            ttft_met=int(ttft_ok.sum()),
            tpot_met=int(tpot_ok.sum()),
            ttft_ms=_percentiles(self._ttft),
            tpot_ms=_percentiles(self._tpot),
            replica_hours=hours,
            peak_replicas={pool: self._peak(pool) for pool in POOLS},
            scale_events=dict(self._scale_events),
            simulated_s=self.now,
            wall_s=wall_s,
            timeline=list(self._timeline),
        )

    def _peak(self, pool: str) -> int:
        counts = [n for _, p, n, _ in self._timeline if p == pool]
        return max(counts, default=len(self._all[pool]))


# Routing keys, on the pool's own kind of worker (a prefill or a decode one).


def _queued_tokens(replica: Replica) -> int:
    return replica.worker.queued_tokens


def _sequences(replica: Replica) -> int:
    w = replica.worker
    return len(w.active) + len(w.joining) + len(w.waiting) + w.num_pulling


def _percentiles(seconds: np.ndarray) -> dict[str, float]:
    values = seconds[~np.isnan(seconds)] * 1e3
    if not len(values):
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}
