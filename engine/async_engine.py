"""Drive an ``LLMEngine`` from asyncio: the engine steps on its own thread, coroutines
submit work and await results.

Threading contract: only the engine thread touches the ``LLMEngine`` (and so the KV
cache). Coroutines reach it through ``call(fn)``, which runs ``fn(engine)`` between two
steps, and receive per-request deltas through asyncio queues fed once per step. A
request whose consumer stops listening (cancelled RPC, closed stream) is aborted, so
its blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from tandem.common.faults import fault_at
from tandem.common.sampling_params import SamplingParams
from tandem.engine.llm_engine import Handover, LLMEngine
from tandem.engine.outputs import EngineLoad, RequestDelta
from tandem.engine.request import PrefillMode
from tandem.engine.scheduler import KVPull

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.02
"""How long the engine thread sleeps on its command queue when nothing can run."""


class EngineStopped(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); the request cannot finish."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_kv_pull: Callable[[KVPull], Awaitable[None]] | None = None,
    ) -> None:
        """``on_kv_pull`` (decode workers) is scheduled on the event loop for every pull
        the engine asks for; it must end with ``finish_kv_pull`` (via ``call``)."""
        self.engine = engine
        self.on_kv_pull = on_kv_pull
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._closing: set[str] = set()
        """Ids whose stream was left early and whose abort the engine has not run yet:
        their deltas may still arrive, so the id is not free for a new request."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._tasks: set[asyncio.Future[None]] = set()
        self._load = engine.load()
        self._advanced_at = time.monotonic()
        self._fault = fault_at("engine.step")

    @property
    def load(self) -> EngineLoad:
        """Refreshed after every step; safe to read from any thread."""
        return self._load

    @property
    def stalled_for_s(self) -> float:
        """Seconds since the engine thread last went round its loop. It goes round at
        least every ``IDLE_WAIT_S`` when idle and once per step when busy, so a value
        far above a step's time means a step or a command is stuck. Any thread."""
        return time.monotonic() - self._advanced_at

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        if self._stopping.is_set():
            raise EngineStopped("the engine is shutting down")
        self._commands.put(run)
        return await future

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
        prefill_mode: PrefillMode = PrefillMode.LOCAL,
        num_remote_tokens: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas until it finishes (or, for ``HAND_OFF``,
        until its first token is out; or until ``migrate_out`` takes it: then the last
        delta carries the ``handover``). ``ValueError`` if the engine refuses it, or if
        ``request_id`` still names a request here (one running, or left early and not
        yet aborted). Leaving the loop early aborts the request."""
        if request_id in self._streams or request_id in self._closing:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.structured is not None:  # compile off the engine thread (cached after)
            await asyncio.to_thread(self.engine.structured.prepare, params.structured)
        stream: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        done = False
        try:
            await self.call(
                lambda e: e.add_request(
                    prompt_token_ids,
                    params,
                    request_id,
                    priority,
                    output_token_ids,
                    prefill_mode,
                    num_remote_tokens,
                    lora_name,
                )
            )
            while not done:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                done = item.finished or item.prefilled or item.handover is not None
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not done and not self._stopping.is_set():
                self._closing.add(request_id)

                def abort() -> None:
                    self.engine.abort_request(request_id)
                    self._post(self._closing.discard, request_id)

                self._commands.put(abort)

    async def migrate_out(self, request_ids: Sequence[str]) -> dict[str, Handover]:
        """Take running requests off this engine (``LLMEngine.migrate_out``), in one
        command; each one's stream then ends with a delta carrying its ``Handover``,
        after every delta of the steps before (both reach the event loop in the engine
        thread's order). Requests unknown or done are left out of the result."""

        def take(engine: LLMEngine) -> dict[str, Handover]:
            taken = {rid: engine.migrate_out(rid) for rid in request_ids}
            return {rid: h for rid, h in taken.items() if h is not None}

        handovers = await self.call(take)
        for rid, handover in handovers.items():
            stream = self._streams.get(rid)
            if stream is not None:  # else its consumer left: the engine frees it on abort
                stream.put_nowait(RequestDelta(rid, [], "", None, [], handover=handover))
        return handovers

    # --- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._advanced_at = time.monotonic()
            nothing_to_do = self.engine.last_step_idle or not self.engine.has_unfinished_requests()
            if self._drain_commands(block=nothing_to_do):
                self._load = self.engine.load()
            if not self.engine.has_unfinished_requests():
                continue
            if self._fault is not None:  # fault point engine.step: delay or crash
                self._fault.fire()
            try:
                deltas = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; aborting all requests")
                self._fail_all(exc)
                continue
            pulls = self.engine.take_kv_pulls()
            self._load = self.engine.load()
            if deltas or pulls:
                self._post(self._deliver, deltas, pulls)
        self._post(self._fail_streams, EngineStopped("the engine stopped"))

    def _drain_commands(self, block: bool) -> int:
        """Run queued commands (waiting a little for one when ``block``); returns how many."""
        try:
            if block:
                command = self._commands.get(timeout=IDLE_WAIT_S)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return 0
        count = 0
        while True:
            command()
            count += 1
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return count

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self._load = self.engine.load()
        self._post(self._fail_streams, EngineStopped(f"engine step failed: {exc}"))

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # --- the event loop side -----------------------------------------------------------

    def _deliver(self, deltas: list[RequestDelta], pulls: list[KVPull]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
        for pull in pulls:
            if self.on_kv_pull is None:  # nobody can pull: compute the prompt here
                rid = pull.request.request_id
                self._commands.put(lambda rid=rid: self.engine.finish_kv_pull(rid, None))
                continue
            task = asyncio.ensure_future(self.on_kv_pull(pull))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
