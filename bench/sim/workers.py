"""Simulated prefill and decode workers: the real engine's behaviour at the level
routing sees, with step times from ``Calibration``.

* ``SimCache`` — a worker's prefix cache: an LRU of block names; a request matches its
  leading cached blocks (leaving at least one token to compute, as the engine does)
  and, once computed or pulled, stores its blocks, evicting the least recently used.
  A prompt's blocks are refreshed tail first, as the engine frees them, so its tail is
  evicted before its head and what stays cached is always a prefix.
* ``SimPrefillWorker`` — FIFO chunked prefill: each step takes up to
  ``max_num_batched_tokens`` new tokens from the front of the queue; a request looks up
  the cache when it first gets budget; when its last chunk is done its first token is
  out and its blocks are stored (and published as events). Like a real prefill worker
  it reports its load (queue, busy share) only at heartbeats; the router adds what it
  sent since (``tandem.router.routing.inflight``).
* ``SimDecodeWorker`` — pulls the blocks it lacks (``pull_time``), then joins a
  continuous batch of at most ``max_num_seqs``; every step yields a token per sequence.

Workers talk to the simulation through a ``Host`` (the clock, scheduling, load and
event reports, completions); one step is one scheduled event, whatever the batch.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.bench.sim.calibration import Calibration
from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, KVCacheEvent
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from tandem.common.worker_load import BusyMeter
from tandem.router.routing.inflight import Ticket


@dataclass(eq=False)
class Job:
    """One request's trip through the simulated fleet."""

    rid: int
    names: tuple[bytes, ...]
    num_tokens: int
    max_tokens: int
    arrived: float
    measured: bool
    admitted: bool = False
    remaining: int = 0
    context: int = 0
    computed: int = 0
    first_token_at: float = 0.0
    finish_step: int = 0
    decision_s: float = 0.0
    cached_blocks: int = 0
    ticket: Ticket | None = None  # the router's in-flight prefill

    @property
    def request_id(self) -> str:
        return f"req-{self.rid}"


class Host(Protocol):
    now: float

    def after(self, delay: float, fn: Callable[..., None], *args: object) -> None: ...

    def load_changed(self, worker: SimPrefillWorker | SimDecodeWorker) -> None: ...

    def publish(self, worker_id: str, events: list[KVCacheEvent]) -> None: ...

    def prefilled(self, job: Job, worker: SimPrefillWorker) -> None: ...

    def decoded(self, job: Job) -> None: ...


class SimCache:
    def __init__(self, capacity_blocks: int, report: bool = True) -> None:
        """``report=False``: ``store`` returns no events (no router is listening)."""
        self.capacity = capacity_blocks
        self.report = report
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, names: Sequence[bytes], limit: int) -> int:
        """Leading ``names`` cached, at most ``limit``; touches them (LRU)."""
        blocks = self.blocks
        n = 0
        for name in names[:limit]:
            if name not in blocks:
                break
            n += 1
        touch = blocks.move_to_end
        for i in range(n - 1, -1, -1):
            touch(names[i])
        return n

    def store(self, names: Sequence[bytes], skip: int = 0) -> list[KVCacheEvent]:
        """Cache ``names`` (the first ``skip`` were just matched, so they are cached and
        fresh already); the events this caused."""
        blocks = self.blocks
        stored = []
        for i in range(len(names) - 1, skip - 1, -1):  # tail first: the head stays freshest
            name = names[i]
            if name in blocks:
                blocks.move_to_end(name)
            else:
                blocks[name] = None
                stored.append(name)
        stored.reverse()
        excess = len(blocks) - self.capacity
        evicted = [blocks.popitem(last=False)[0] for _ in range(excess)] if excess > 0 else ()
        if not self.report:
            return []
        events: list[KVCacheEvent] = []
        if evicted:
            events.append(BlocksEvicted(tuple(evicted)))
            stored = [n for n in stored if n in blocks]
        if stored:
            events.append(BlocksStored(tuple(stored), None))
        return events


class _Worker(ABC):
    def __init__(
        self,
        host: Host,
        worker_id: str,
        role: WorkerRole,
        capacity: WorkerCapacity,
        cal: Calibration,
        report: bool,
    ) -> None:
        self.host = host
        self.worker_id = worker_id
        self.info = WorkerInfo(worker_id, role, f"sim:{worker_id}", "sim", capacity)
        self.cal = cal
        self.block_size = capacity.block_size
        self.cache = SimCache(capacity.num_kv_blocks, report)

    @abstractmethod
    def record(self) -> WorkerRecord:
        """What the registry would say of this worker now."""

    def _publish(self, events: list[KVCacheEvent]) -> None:
        if events:
            self.host.publish(self.worker_id, events)


class SimPrefillWorker(_Worker):
    def __init__(
        self, host: Host, worker_id: str, capacity: WorkerCapacity, cal: Calibration, report: bool
    ):
        super().__init__(host, worker_id, WorkerRole.PREFILL, capacity, cal, report)
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0
        self.busy = False
        self.computed_tokens = 0
        self.busy_seconds = 0.0  # steps started, counted whole when they start
        self.meter = BusyMeter(clock=lambda: host.now)
        self._reported = WorkerRecord(self.info, WorkerLoad(capacity.num_kv_blocks, 0, 0, 0, 0.0))

    def heartbeat(self) -> None:
        """What a real worker reports once per heartbeat: its queue and recent busy share."""
        load = WorkerLoad(
            self.info.capacity.num_kv_blocks,
            0,
            len(self.queue),
            self.queued_tokens,
            self.host.now,
            self.meter.update(self.busy_seconds),
        )
        self._reported = WorkerRecord(self.info, load)

    def record(self) -> WorkerRecord:
        """The last heartbeat's report."""
        return self._reported

    def enqueue(self, job: Job, expected_cached_blocks: int) -> None:
        """``expected_cached_blocks``: what the worker's cache holds now (the queued-token
        estimate until the job is admitted and looks the cache up itself)."""
        job.remaining = max(1, job.num_tokens - expected_cached_blocks * self.block_size)
        self.queue.append(job)
        self.queued_tokens += job.remaining
        if not self.busy:
            self._step()
        self.host.load_changed(self)

    def _step(self) -> None:
        budget = self.cal.max_num_batched_tokens
        chunks: list[tuple[Job, int]] = []
        new = weighted = 0
        for job in self.queue:
            if not budget:
                break
            if not job.admitted:
                self._admit(job)
            take = min(job.remaining, budget)
            chunks.append((job, take))
            new += take
            weighted += take * self.cal.attended(take, job.context)
            budget -= take
        self.busy = True
        step = self.cal.prefill_step_s + self.cal.prefill_token_s * new
        step += self.cal.prefill_context_token_s * weighted / 1000
        self.busy_seconds += step
        self.host.after(step, self._step_done, chunks)

    def _admit(self, job: Job) -> None:
        limit = (job.num_tokens - 1) // self.block_size
        job.cached_blocks = self.cache.match(job.names, limit)
        cached = job.cached_blocks * self.block_size
        estimate, job.remaining = job.remaining, job.num_tokens - cached
        job.context, job.admitted = cached, True
        self.queued_tokens += job.remaining - estimate

    def _step_done(self, chunks: list[tuple[Job, int]]) -> None:
        for job, take in chunks:
            job.remaining -= take
            job.context += take
            job.computed += take
            self.queued_tokens -= take
            self.computed_tokens += take
        done = []
        while self.queue and self.queue[0].remaining == 0:
            done.append(self.queue.popleft())
        self.busy = False
        for job in done:
            self._publish(self.cache.store(job.names, job.cached_blocks))
            self.host.prefilled(job, self)
        if self.queue:
            self._step()
        self.host.load_changed(self)


class SimDecodeWorker(_Worker):
    """Continuous batching, simulated a *run* of identical steps at a time: between two
    changes of the batch (a sequence finishing, or one joining at a step boundary) the
    steps differ only by the KV they read, so the run's end is computed in closed form
    and scheduled as one event. A join in the middle of a run cuts it at the end of the
    step in progress. Events are O(requests), not O(steps)."""

    def __init__(
        self, host: Host, worker_id: str, capacity: WorkerCapacity, cal: Calibration, report: bool
    ):
        super().__init__(host, worker_id, WorkerRole.DECODE, capacity, cal, report)
        self.active: list[tuple[int, int, Job]] = []  # heap by finishing step
        self.waiting: deque[Job] = deque()  # pulled, no batch slot yet
        self.joining: list[Job] = []  # pulled, joining at the next step boundary
        self.num_pulling = 0
        self.step_no = 0
        self.kv_tokens = 0
        self.held_blocks = 0
        self.blocks_pulled = 0
        self.finished_run_tokens = 0  # output tokens of the runs that ended
        self._run_start = 0.0
        self._run_steps = 0  # 0: idle
        self._run_token = 0  # outdates scheduled events of a cut run
        self._cut = False

    def record(self) -> WorkerRecord:
        capacity = self.info.capacity
        running = len(self.active) + len(self.joining) + self.num_pulling
        free = max(0, capacity.num_kv_blocks - self.held_blocks)
        load = WorkerLoad(free, running, len(self.waiting), 0, 0.0)
        return WorkerRecord(self.info, load)

    def admit(self, job: Job) -> None:
        """Take over ``job`` after its prefill: pull what this worker lacks, then decode."""
        limit = (job.num_tokens - 1) // self.block_size
        have = self.cache.match(job.names, limit)
        job.cached_blocks = have
        missing = -(-job.num_tokens // self.block_size) - have
        self.blocks_pulled += missing
        self.held_blocks += self._blocks_of(job)
        self.num_pulling += 1
        self.host.after(self.cal.pull_time(missing), self._pulled, job)
        self.host.load_changed(self)

    def _blocks_of(self, job: Job) -> int:
        return -(-(job.num_tokens + job.max_tokens) // self.block_size)

    def _pulled(self, job: Job) -> None:
        self.num_pulling -= 1
        self._publish(self.cache.store(job.names, job.cached_blocks))
        if job.max_tokens <= 1:
            self._finish(job)
        elif not self._run_steps:
            self._join(job)
            self._start_run()
        else:
            self.joining.append(job)
            self._cut_run()
        self.host.load_changed(self)

    # --- runs of steps -----------------------------------------------------------------

    def _run_time(self, k: int) -> float:
        """Seconds for the next ``k`` steps of the current batch."""
        b, cal = len(self.active), self.cal
        first = cal.decode_step_s + cal.decode_seq_s * b + cal.decode_kv_token_s * self.kv_tokens
        return k * first + cal.decode_kv_token_s * b * k * (k - 1) / 2

    def _start_run(self) -> None:
        self._run_token += 1
        self._run_start = self.host.now
        self._cut = False
        if not self.active:
            self._run_steps = 0
            return
        self._run_steps = self.active[0][0] - self.step_no
        self.host.after(self._run_time(self._run_steps), self._end_run, self._run_token)

    def _steps_done(self) -> int:
        """Steps of the current run finished by now: the largest k with run_time(k) <=
        the time since it started."""
        elapsed = self.host.now - self._run_start
        lo, hi = 0, self._run_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._run_time(mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tokens_generated(self) -> int:
        """Output tokens generated so far (a token counts once its step has ended), as the
        worker's generation counter would read now."""
        if not self._run_steps:
            return self.finished_run_tokens
        return self.finished_run_tokens + len(self.active) * self._steps_done()

    def _cut_run(self) -> None:
        """End the run at the end of the step in progress (once per run)."""
        if self._cut:
            return
        steps = min(self._steps_done() + 1, self._run_steps)
        self._run_steps = steps
        self._run_token += 1
        self._cut = True
        delay = self._run_start + self._run_time(steps) - self.host.now
        self.host.after(max(0.0, delay), self._end_run, self._run_token)

    def _end_run(self, token: int) -> None:
        if token != self._run_token:
            return
        self.finished_run_tokens += len(self.active) * self._run_steps
        self.step_no += self._run_steps
        self.kv_tokens += len(self.active) * self._run_steps
        while self.active and self.active[0][0] <= self.step_no:
            job = heapq.heappop(self.active)[2]
            self.kv_tokens -= job.num_tokens + job.max_tokens
            self._finish(job)
        for job in self.joining:
            self._enter(job)
        self.joining.clear()
        while self.waiting and len(self.active) < self.info.capacity.max_num_seqs:
            self._join(self.waiting.popleft())
        self._start_run()
        self.host.load_changed(self)

    def _enter(self, job: Job) -> None:
        if len(self.active) < self.info.capacity.max_num_seqs:
            self._join(job)
        else:
            self.waiting.append(job)

    def _join(self, job: Job) -> None:
        job.finish_step = self.step_no + job.max_tokens - 1
        heapq.heappush(self.active, (job.finish_step, job.rid, job))
        self.kv_tokens += job.num_tokens + 1

    def _finish(self, job: Job) -> None:
        self.held_blocks -= self._blocks_of(job)
        self.host.decoded(job)
