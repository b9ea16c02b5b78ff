"""The fleet simulation: arrivals -> the router's real policies and KV indexer ->
simulated prefill and decode workers, on a discrete-event clock.

What is real and what is simulated:

* real: the routing policies (``RoundRobin``, ``LeastLoaded``, ``PrefixAwarePolicy``),
  the ``KVIndexer`` and its ``PrefixIndex``, the ``EventBatch`` events it applies, the
  ``RoutingRequest`` it is asked about;
* simulated: workers (``tandem.bench.sim.workers``) with step costs measured on the real
  engine, the event stream (a fixed lag between a worker's step and the index seeing
  its events), and the registry: prefill workers report their load at staggered
  heartbeats, which the router's real ``InflightLoad`` merges with the work it sent
  since, as the router does (decode workers' load the router sees exactly: its streams
  are its in-flight count);
* ``oracle``: the prefix-aware policy reading an index with no lag at all, i.e. every
  worker's cache as it is at the moment of the decision.

Decision time is the CPU time (``time.thread_time``: a busy machine's other processes
do not count) the real router code takes per request — index lookup, building the
routing request, the policy — prefill and decode picks together; the garbage collector
is off during a run (the simulation makes no reference cycles). Block names come from
``tandem.bench.prefix_workloads.BlockNamer`` (hashing is timed separately, on the router path,
by ``bench/routing_decision.py``).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from tandem.bench.prefix_workloads import BlockNamer, PromptPlan
from tandem.bench.sim.calibration import Calibration
from tandem.bench.sim.workers import Job, SimDecodeWorker, SimPrefillWorker
from tandem.common.kv_events.events import KVCacheEvent
from tandem.common.kv_events.wire import CacheSnapshot, EventBatch
from tandem.common.registry import WorkerCapacity, WorkerRole
from tandem.router.kv_index.index import EMPTY_MATCH
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.routing.inflight import InflightLoad
from tandem.router.routing.policy import LeastLoaded, RoundRobin, RoutingPolicy, RoutingRequest
from tandem.router.routing.pool_view import IndexedPool
from tandem.router.routing.prefix_aware import PrefixAwarePolicy, PrefixCost

ROUTERS = ("round_robin", "least_loaded", "prefix_aware", "oracle")


@dataclass(frozen=True)
class FleetSpec:
    num_prefill: int = 800
    num_decode: int = 200
    prefill_kv_blocks: int = 8192
    decode_kv_blocks: int = 16384
    max_num_seqs: int = 256
    event_lag_s: float = 0.005
    """Worker step end -> router index: publish, XADD, XREAD (measured: a few ms)."""
    warmup_s: float = 10.0
    """Requests arriving earlier warm the caches and are left out of the figures."""
    heartbeat_s: float = 1.0
    """Prefill workers report their load this often (staggered), as real ones do with
    their registry heartbeat."""


@dataclass
class SimResult:
    router: str
    requests: int
    prompt_tokens: int
    computed_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    decision_us: dict[str, float]
    queue_imbalance: float
    """max / mean over prefill workers of their time-averaged queued prefill tokens."""
    work_imbalance: float
    """max / mean over prefill workers of the prefill tokens they computed."""
    mean_queued_tokens: float
    blocks_pulled: int
    simulated_s: float
    wall_s: float
    events: int
    index_entries: int = 0
    peak_memory_gb: float = 0.0
    """The process's peak resident memory, when the caller measures it."""

    @property
    def hit_rate(self) -> float:
        return 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Stats:
    prompt_tokens: int = 0
    computed_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    decision: list[float] = field(default_factory=list)


class FleetSim:
    def __init__(
        self,
        fleet: FleetSpec,
        cal: Calibration,
        router: str,
        prefill_cost: PrefixCost | None = None,
        decode_cost: PrefixCost | None = None,
    ) -> None:
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        self.fleet, self.cal, self.router = fleet, cal, router
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._order = itertools.count()
        self.num_events = 0
        self.prefill_policy, self.decode_policy = _policies(router, prefill_cost, decode_cost)
        self.lag: float | None = None  # None: no index
        if router == "prefix_aware":
            self.lag = fleet.event_lag_s
        elif router == "oracle":
            self.lag = 0.0
        self.indexer = KVIndexer() if self.lag is not None else None
        self.inflight = InflightLoad(clock=lambda: self.now)
        self.prefill_pool = IndexedPool(self.prefill_policy.load_key)
        self.decode_pool = IndexedPool(self.decode_policy.load_key)
        self.namer = BlockNamer(cal.block_size)
        self._seq: dict[str, int] = {}
        self._stats = _Stats()
        report = self.indexer is not None
        self.prefill_workers = [
            SimPrefillWorker(
                self, f"p{i:04d}", self._capacity(fleet.prefill_kv_blocks), cal, report
            )
            for i in range(fleet.num_prefill)
        ]
        self.decode_workers = [
            SimDecodeWorker(self, f"d{i:04d}", self._capacity(fleet.decode_kv_blocks), cal, report)
            for i in range(fleet.num_decode)
        ]
        self._decode_by_id = {w.worker_id: w for w in self.decode_workers}
        self._queued_area = np.zeros(fleet.num_prefill)
        self._queued_at = np.zeros(fleet.num_prefill)
        self._queued = np.zeros(fleet.num_prefill)
        self._prefill_index = {w.worker_id: i for i, w in enumerate(self.prefill_workers)}
        self._area_at_warmup = np.zeros(fleet.num_prefill)
        self._computed_at_warmup = np.zeros(fleet.num_prefill)
        self._pulled_at_warmup = 0
        for worker in (*self.prefill_workers, *self.decode_workers):
            self._join(worker)
        self._arriving = True
        for i, worker in enumerate(self.prefill_workers):
            self.after(fleet.heartbeat_s * (i + 1) / fleet.num_prefill, self._heartbeat, worker)

    # --- the clock (Host) --------------------------------------------------------------

    def after(self, delay: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._queue, (self.now + delay, next(self._order), fn, args))

    def run(self, plans: Iterable[PromptPlan]) -> SimResult:
        started = time.perf_counter()
        arrivals = iter(enumerate(plans))
        self._next_arrival(arrivals)
        self.after(self.fleet.warmup_s, self._warmed_up)
        queue = self._queue
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            while queue:
                self.now, _, fn, args = heapq.heappop(queue)
                self.num_events += 1
                fn(*args)
        finally:
            if gc_was_enabled:
                gc.enable()
        return self._result(time.perf_counter() - started)

    # --- arrivals and routing ----------------------------------------------------------

    def _next_arrival(self, arrivals) -> None:
        item = next(arrivals, None)
        if item is not None:
            rid, plan = item
            self.after(plan.at - self.now, self._arrive, rid, plan, arrivals)
        else:
            self._arriving = False  # heartbeats stop, so the run ends once work drains

    def _heartbeat(self, worker: SimPrefillWorker) -> None:
        worker.heartbeat()
        self.load_changed(worker)
        if self._arriving:
            self.after(self.fleet.heartbeat_s, self._heartbeat, worker)

    def _arrive(self, rid: int, plan: PromptPlan, arrivals) -> None:
        self._next_arrival(arrivals)
        job = Job(
            rid, self.namer.names(plan), plan.num_tokens, plan.max_tokens, self.now,
            measured=self.now >= self.fleet.warmup_s,
        )  # fmt: skip
        worker, matched, seconds = self._pick(job, self.prefill_policy, self.prefill_pool)
        job.decision_s = seconds
        uncached = max(1, job.num_tokens - matched * self.cal.block_size)
        job.ticket = self.inflight.begin_prefill(worker, uncached)
        self.prefill_workers[self._prefill_index[worker]].enqueue(job, matched)

    def _pick(self, job: Job, policy: RoutingPolicy, pool: IndexedPool) -> tuple[str, int, float]:
        start = time.thread_time()
        matched = EMPTY_MATCH
        if self.indexer is not None and policy.uses_prefix_match:
            matched = self.indexer.overlap(job.names)
        request = RoutingRequest(job.request_id, job.num_tokens, job.names, 0, matched)
        choice = policy.choose(request, pool)
        assert choice is not None
        policy.record(request, choice)
        worker_id = choice.info.worker_id
        return worker_id, matched.get(worker_id, 0), time.thread_time() - start

    def prefilled(self, job: Job, worker: SimPrefillWorker) -> None:
        """``job``'s first token is out (``worker`` reports its load change next)."""
        assert job.ticket is not None
        self.inflight.end(job.ticket)
        job.first_token_at = self.now
        worker_id, _, seconds = self._pick(job, self.decode_policy, self.decode_pool)
        if job.measured:
            stats = self._stats
            stats.prompt_tokens += job.num_tokens
            stats.computed_tokens += job.computed
            stats.ttft.append(self.now - job.arrived)
            stats.decision.append(job.decision_s + seconds)
        self._decode_by_id[worker_id].admit(job)

    def decoded(self, job: Job) -> None:
        if job.measured and job.max_tokens > 1:
            self._stats.tpot.append((self.now - job.first_token_at) / (job.max_tokens - 1))

    # --- load and events ---------------------------------------------------------------

    def load_changed(self, worker: SimPrefillWorker | SimDecodeWorker) -> None:
        if isinstance(worker, SimPrefillWorker):
            i = self._prefill_index[worker.worker_id]
            self._queued_area[i] += self._queued[i] * (self.now - self._queued_at[i])
            self._queued_at[i] = self.now
            self._queued[i] = worker.queued_tokens
            self.prefill_pool.update(self.inflight.adjust([worker.record()])[0])
        else:
            self.decode_pool.update(worker.record())

    def publish(self, worker_id: str, events: list[KVCacheEvent]) -> None:
        if self.indexer is None:
            return
        seq = self._seq[worker_id] = self._seq[worker_id] + 1
        batch = EventBatch(worker_id, 1, seq, tuple(events), self.now)
        if self.lag:
            self.after(self.lag, self.indexer.apply, batch)
        else:
            self.indexer.apply(batch)

    def _join(self, worker: SimPrefillWorker | SimDecodeWorker) -> None:
        self._seq[worker.worker_id] = 0
        if self.indexer is not None:
            self.indexer.worker_joined(worker.worker_id)
            self.indexer.apply_snapshot(
                CacheSnapshot(worker.worker_id, 1, 0, (), self.cal.block_size)
            )
        self.load_changed(worker)

    def _capacity(self, blocks: int) -> WorkerCapacity:
        return WorkerCapacity(blocks, self.cal.block_size, self.fleet.max_num_seqs)

    # --- figures -----------------------------------------------------------------------

    def _warmed_up(self) -> None:
        self._flush_queued()
        self._area_at_warmup = self._queued_area.copy()
        self._computed_at_warmup = np.array([w.computed_tokens for w in self.prefill_workers])
        self._pulled_at_warmup = sum(w.blocks_pulled for w in self.decode_workers)

    def _flush_queued(self) -> None:
        self._queued_area += self._queued * (self.now - self._queued_at)
        self._queued_at[:] = self.now

    def _result(self, wall_s: float) -> SimResult:
        self._flush_queued()
        span = max(1e-9, self.now - self.fleet.warmup_s)
        queued = (self._queued_area - self._area_at_warmup) / span
        computed = np.array([w.computed_tokens for w in self.prefill_workers])
        computed = computed - self._computed_at_warmup
        stats = self._stats
        return SimResult(
            router=self.router,
            requests=len(stats.ttft),
            prompt_tokens=stats.prompt_tokens,
            computed_tokens=stats.computed_tokens,
            ttft_ms=_percentiles(stats.ttft, 1e3),
            tpot_ms=_percentiles(stats.tpot, 1e3),
            decision_us=_percentiles(stats.decision, 1e6),
            queue_imbalance=_imbalance(queued),
            work_imbalance=_imbalance(computed),
            mean_queued_tokens=float(queued.mean()),
            blocks_pulled=sum(w.blocks_pulled for w in self.decode_workers)
            - self._pulled_at_warmup,
            simulated_s=self.now,
            wall_s=wall_s,
            events=self.num_events,
            index_entries=self.indexer.index.num_entries if self.indexer else 0,
        )


def _policies(
    router: str, prefill_cost: PrefixCost | None, decode_cost: PrefixCost | None
) -> tuple[RoutingPolicy, RoutingPolicy]:
    if router == "round_robin":
        return RoundRobin(), RoundRobin()
    if router == "least_loaded":
        return LeastLoaded(), LeastLoaded()
    return (
        PrefixAwarePolicy(prefill_cost or PrefixCost.default_for(WorkerRole.PREFILL)),
        PrefixAwarePolicy(decode_cost or PrefixCost.default_for(WorkerRole.DECODE)),
    )


def _percentiles(values: list[float], scale: float) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    array = np.asarray(values) * scale
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _imbalance(per_worker: np.ndarray) -> float:
    mean = float(per_worker.mean())
    return float(per_worker.max()) / mean if mean > 0 else float("nan")
