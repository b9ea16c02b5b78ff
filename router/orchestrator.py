"""The request path behind the router: prefill on one worker, decode on another.

``Orchestrator.run`` yields a request's tokens as the workers produce them:

1. A prompt of at least ``disaggregation_min_tokens`` tokens goes to a prefill worker,
   whose first token is yielded at once (TTFT); a failed prefill worker is retried on
   another, and with none left the decode worker prefills locally. Conditional
   disaggregation keeps a prompt on the decode side when a decode worker holds more of
   it than any prefill worker and little is left to compute (``_prefill_remotely``).
2. A decode worker continues from the first token, pulling the prompt's KV from the
   prefill worker named in the handle. If it fails mid-stream, the next decode worker
   gets the prompt plus every token produced so far (no handle: it recomputes them)
   and the stream continues unbroken. A decode worker may also hand the stream over
   (it drains, or rebalances): its last message names its KV, and the next worker gets
   the tokens with that handle, pulling the KV instead of recomputing it.
3. Whatever ends the request early — client cancel, deadline, a stop string — closes
   the worker streams, which aborts the request on the workers and frees its blocks;
   a lease that no decode worker took is released with ``Abort`` on its prefill worker.

Routing: a request's chained block hashes are computed once (with the workers' block
size, only when a policy reads them); before each pick the KV index is asked which
workers hold the prompt's prefix, and the pool's reported load is merged with the work
this router has in flight (``tandem.router.routing.inflight``). The policy decides on that snapshot;
this module records the decision's time, the prefix hits the workers report, and the
in-flight work until it finishes.

Torch-free. The policies decide; this module only dispatches and recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

import grpc

from tandem.common import tracing
from tandem.common.hashing import hash_blocks, root_hash
from tandem.common.registry import RegistryWatcher, WorkerRecord, WorkerRole
from tandem.common.wire import FINISH_REASON_FROM_PROTO, MIGRATION_CAUSE_NAMES, sampling_to_proto
from tandem.protos import common_pb2, worker_pb2
from tandem.router.clients import WorkerClients
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.metrics import RouterMetrics
from tandem.router.routing.adapters import DEFAULT_COLD_LOAD_TOKENS, excluded_for_adapter
from tandem.router.routing.inflight import InflightLoad
from tandem.router.routing.live_pools import LivePools
from tandem.router.routing.policy import RoutingPolicy, RoutingRequest
from tandem.router.stall import StallPolicy, StreamClock, StreamStalled
from tandem.router.suspects import DEFAULT_HOLD_S, Suspects
from tandem.router.validation import ValidatedRequest

log = logging.getLogger(__name__)

# A worker that fails with one of these is gone or broken: try another one.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
    }
)


def worker_failed(err: BaseException) -> bool:
    """Whether a worker call failed in a way another worker can make good: a retryable
    status, or the call cancelled under us (its channel was closed) while the request's
    own task is not being cancelled. A client that cancels cancels the task, and that
    ``CancelledError`` must propagate."""
    if isinstance(err, grpc.aio.AioRpcError):
        return err.code() in RETRYABLE
    task = asyncio.current_task()
    return isinstance(err, asyncio.CancelledError) and task is not None and not task.cancelling()


MAX_HANDOVERS = 32
"""Hand-overs one stream may go through (each is a worker's choice, not a failure)."""


class NoWorkerAvailable(Exception):
    """No live worker can serve the request (maps to ``UNAVAILABLE``)."""


@dataclass(frozen=True)
class OrchestratorConfig:
    disaggregation_min_tokens: int = 32
    """Shorter prompts skip the prefill pool: the decode worker prefills them itself."""
    max_local_prefill_tokens: int = 512
    """Conditional disaggregation: a prompt of which a decode worker holds more than any
    prefill worker (a conversation's earlier turns, answers included) skips the prefill
    pool when at most this many of its tokens are left to compute there (0: off)."""
    max_prefill_attempts: int = 2
    max_decode_attempts: int = 3
    stall: StallPolicy = StallPolicy()
    """When a decode stream that sends nothing counts as stalled (``router.stall``)."""
    suspect_hold_s: float = DEFAULT_HOLD_S
    """How long a worker a call just failed or stalled on is avoided (``router.suspects``)."""
    lora_cold_load_tokens: int = DEFAULT_COLD_LOAD_TOKENS
    """What reading a LoRA adapter from disk costs, in queued prompt tokens: a worker
    with the adapter in memory is preferred unless its work exceeds the least by more
    (``routing.adapters``)."""


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[common_pb2.TokenLogprobs, ...]
    finish_reason: str | None


@dataclass
class RequestTrace:
    """What happened to one request: for usage reporting, logs and tests."""

    prefill_worker: str | None = None
    decode_workers: list[str] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    kv_source: int = worker_pb2.KV_SOURCE_UNSPECIFIED
    blocks_pulled: int = 0
    first_token_at: float | None = None
    predicted_prefix_blocks: int = 0
    """What the KV index said the chosen prefill worker holds of the prompt."""
    span: tracing.AnySpan = tracing.NO_SPAN
    """The request's span (``tandem.router.request``): routing, the prefill and each
    decode attempt are traced under it."""


@dataclass
class _Moves:
    """Where a decode stream has been: what its next pick avoids and the KV it carries."""

    handle: worker_pb2.KVHandle | None
    """The KV the next worker pulls: the prefill's, or the last hand-over's."""
    tried: set[str] = field(default_factory=set)
    """Workers the stream failed or stalled on."""
    last: str | None = None
    """The worker the stream just left, for any reason."""
    failures: int = 0
    handovers: int = 0

    def exhausted(self, max_failures: int) -> bool:
        return self.failures >= max_failures or self.handovers > MAX_HANDOVERS

    def excludes(self, suspects: frozenset[str] | set[str]) -> tuple[set[str], ...]:
        """Exclusion sets to pick with, the first that leaves anyone winning: an untried
        worker first, never the one just left while another can take the stream; once
        every one was tried, one still registered may take it again (a stream can fail
        while its worker is fine), another than the one just left if possible. Suspects
        only when nothing else is left."""
        just_left = {self.last} if self.last is not None else self.tried
        tried = self.tried
        return (
            tried | just_left | suspects,
            just_left | suspects,
            set(suspects),
            tried,
            just_left,
            set(),
        )

    def left(self, worker_id: str, moved: worker_pb2.DecodeResponse | None, why: str | None) -> str:
        """The stream left ``worker_id``: handed over with ``moved`` (the next worker
        pulls the KV it names), or failed for ``why`` (the next one recomputes prompt and
        tokens). Returns the cause, a metric label."""
        self.last = worker_id
        if moved is not None:
            self.handovers += 1
            self.handle = moved.handoff if moved.HasField("handoff") else None
            return MIGRATION_CAUSE_NAMES.get(moved.migration_cause, "requested")
        self.failures += 1
        self.tried.add(worker_id)
        self.handle = None
        return "stall" if why is not None and why.startswith("stalled") else "failure"


@dataclass(frozen=True)
class _Pick:
    worker: WorkerRecord
    matched_blocks: int  # the index's answer for this worker (0 without an index)


class Orchestrator:
    def __init__(
        self,
        watcher: RegistryWatcher,
        clients: WorkerClients,
        prefill_policy: RoutingPolicy,
        decode_policy: RoutingPolicy,
        config: OrchestratorConfig,
        indexer: KVIndexer | None = None,
        inflight: InflightLoad | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        """``indexer``: the KV index prefix-aware policies read (``None``: they see no
        cached prefixes). ``inflight`` and ``metrics`` default to fresh ones."""
        self.watcher = watcher
        self.clients = clients
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.config = config
        self.indexer = indexer
        self.inflight = inflight or InflightLoad()
        self.metrics = metrics or RouterMetrics()
        self.pools = LivePools(
            watcher,
            self.inflight,
            {
                WorkerRole.PREFILL: prefill_policy.load_key,
                WorkerRole.DECODE: decode_policy.load_key,
            },
        )
        self._uses_index = indexer is not None and (
            prefill_policy.uses_prefix_match or decode_policy.uses_prefix_match
        )
        self._background: set[asyncio.Future[None]] = set()
        self.suspects = Suspects(config.suspect_hold_s)

    async def run(
        self, request: ValidatedRequest, trace: RequestTrace, deadline: float | None
    ) -> AsyncIterator[TokenChunk]:
        """Yield the request's tokens; ``deadline`` is a ``time.monotonic()`` instant."""
        routing = self._routing_request(request)
        produced: list[int] = []
        handle = None
        try:
            if self._prefill_remotely(request, routing, trace):
                prefill = await self._prefill(request, routing, trace, deadline)
                if prefill is not None:
                    trace.first_token_at = time.monotonic()
                    finish = FINISH_REASON_FROM_PROTO[prefill.finish_reason]
                    first = (prefill.first_logprobs,) if prefill.HasField("first_logprobs") else ()
                    produced.append(prefill.first_token_id)
                    handle = prefill.kv if finish is None else None
                    yield TokenChunk((prefill.first_token_id,), first, finish)
                    if finish is not None:
                        return
            async for chunk in self._decode(request, routing, produced, handle, trace, deadline):
                yield chunk
        finally:
            if handle is not None and not trace.decode_workers:
                self._release_unused_lease(request.request_id, trace)

    # --- prefill -----------------------------------------------------------------------

    def _prefill_remotely(
        self, request: ValidatedRequest, routing: RoutingRequest, trace: RequestTrace
    ) -> bool:
        """Whether a prefill worker should compute the prompt (disaggregated), or the decode
        worker that will run it: short prompts, and — conditional disaggregation — prompts
        whose context a decode worker already holds more of than any prefill worker
        (a multi-turn conversation's earlier answers live only where they were decoded),
        with at most ``max_local_prefill_tokens`` left to compute there and no more work
        to wait for than the remote way: the tokens left plus that worker's queued prefill
        against the prefill pool's uncached tokens plus its shortest queue. Prefilling the
        few new tokens where the rest already is beats a prefill worker recomputing the
        answers and a pull of the whole prompt."""
        if request.num_prompt_tokens < self.config.disaggregation_min_tokens:
            self.metrics.local_prefill("short")
            return False
        if (
            not self.config.max_local_prefill_tokens
            or self.indexer is None
            or not routing.block_hashes
            or not self.decode_policy.uses_prefix_match
        ):
            return True
        suspects = self.suspects.current()
        decode_pool = self.pools.view(
            WorkerRole.DECODE,
            suspects | self._without_adapter(WorkerRole.DECODE, routing, suspects),
        )
        prefill_pool = self.pools.view(
            WorkerRole.PREFILL,
            suspects | self._without_adapter(WorkerRole.PREFILL, routing, suspects),
        )
        holder, held, prefill_held = None, 0, 0
        for worker_id, blocks in self.indexer.overlap(routing.block_hashes).items():
            if prefill_pool.get(worker_id) is not None:
                prefill_held = max(prefill_held, blocks)
            elif decode_pool.get(worker_id) is not None and blocks > held:
                holder, held = decode_pool.get(worker_id), blocks
        if holder is None or held <= prefill_held:
            return True
        block_size = holder.info.capacity.block_size
        left = request.num_prompt_tokens - held * block_size
        remote = request.num_prompt_tokens - prefill_held * block_size
        idlest = prefill_pool.cheapest(1)
        prefill_queue = idlest[0].load.num_queued_prefill_tokens if idlest else 0
        local_wait = left + holder.load.num_queued_prefill_tokens
        if left > self.config.max_local_prefill_tokens or local_wait > remote + prefill_queue:
            return True
        self.metrics.local_prefill("cached_on_decode")
        trace.span.add_event(
            "prefill on the decode worker",
            {
                "tandem.worker": holder.info.worker_id,
                "tandem.cached_on_decode_tokens": held * block_size,
            },
        )
        return False

    async def _prefill(
        self,
        request: ValidatedRequest,
        routing: RoutingRequest,
        trace: RequestTrace,
        deadline: float | None,
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill's answer, or ``None`` when no prefill worker could do it."""
        message = worker_pb2.PrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=_worker_sampling(request),
            priority=request.priority,
            lora_name=request.lora_name or "",
        )
        tried: set[str] = set()
        for _ in range(self.config.max_prefill_attempts):
            suspects = self.suspects.current()
            pick = self._pick_first(
                WorkerRole.PREFILL,
                self.prefill_policy,
                routing,
                (tried | suspects, tried),
                trace.span,
            )
            if pick is None:
                return None
            worker = pick.worker
            cached = pick.matched_blocks * worker.info.capacity.block_size
            ticket = self.pools.begin_prefill(
                worker.info.worker_id, max(1, request.num_prompt_tokens - cached)
            )
            span = _call_span("tandem.router.prefill", trace, worker, len(tried))
            try:
                response = await self.clients.prefill(worker).Prefill(
                    message, timeout=_remaining(deadline), metadata=tracing.metadata(span)
                )
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as err:
                span.fail(_why(err))
                if not worker_failed(err):
                    raise
                log.warning(
                    "prefill on %s failed (%s); trying another", worker.info.worker_id, _why(err)
                )
                trace.span.add_event("prefill retry", {"tandem.worker": worker.info.worker_id})
                tried.add(worker.info.worker_id)
                self.suspects.mark(worker.info.worker_id)
                self.metrics.prefill_retries.inc()
                continue
            finally:
                self.pools.end(ticket)
                span.end()
            span.set_attribute("tandem.cached_prompt_tokens", response.cached_prompt_tokens)
            trace.prefill_worker = worker.info.worker_id
            trace.cached_prompt_tokens = response.cached_prompt_tokens
            trace.predicted_prefix_blocks = pick.matched_blocks
            self.metrics.prefilled(
                self.prefill_policy.name,
                request.num_prompt_tokens,
                response.cached_prompt_tokens,
                cached,
            )
            return response
        return None

    def _release_unused_lease(self, request_id: str, trace: RequestTrace) -> None:
        """The request ended before any decode worker took its KV: free it on the prefill
        worker now rather than at lease expiry. Runs in the background (the caller may be
        a cancelled task)."""
        worker = self.watcher.get(trace.prefill_worker or "")
        if worker is None:
            return
        stub = self.clients.prefill(worker)

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=2.0)

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- decode ------------------------------------------------------------------------

    async def _decode(
        self,
        request: ValidatedRequest,
        routing: RoutingRequest,
        produced: list[int],
        handle: worker_pb2.KVHandle | None,
        trace: RequestTrace,
        deadline: float | None,
    ) -> AsyncIterator[TokenChunk]:
        moves = _Moves(handle)
        for attempt in itertools.count():
            if moves.exhausted(self.config.max_decode_attempts):
                break
            excludes = moves.excludes(self.suspects.current())
            pick = self._pick_first(
                WorkerRole.DECODE, self.decode_policy, routing, excludes, trace.span
            )
            if pick is None:
                break
            worker = pick.worker
            trace.decode_workers.append(worker.info.worker_id)
            num_tokens = request.num_prompt_tokens + request.sampling.max_tokens
            ticket = self.pools.begin_decode(
                worker.info.worker_id, -(-num_tokens // worker.info.capacity.block_size)
            )
            message = _decode_message(request, produced, moves.handle, attempt)
            span = _call_span(
                "tandem.router.decode",
                trace,
                worker,
                attempt,
                {
                    "tandem.kv_handle": moves.handle is not None,
                    "tandem.resumed_tokens": len(produced),
                },
            )
            call = self.clients.decode(worker).Decode(
                message, timeout=_remaining(deadline), metadata=tracing.metadata(span)
            )
            why: str | None = None  # None: finished, or closed by the caller (its choice)
            moved: worker_pb2.DecodeResponse | None = None  # the worker's hand-over message
            try:
                async for response in _within_bounds(call, StreamClock(self.config.stall)):
                    if response.migration_cause:
                        moved = response
                        break
                    self._note_kv(response, trace, span)
                    produced.extend(response.token_ids)
                    finish = FINISH_REASON_FROM_PROTO[response.finish_reason]
                    if trace.first_token_at is None and response.token_ids:
                        trace.first_token_at = time.monotonic()
                        trace.span.add_event("first token")
                    yield TokenChunk(tuple(response.token_ids), tuple(response.logprobs), finish)
                    if finish is not None:
                        return
                else:
                    why = "the stream ended without a finish reason"
                    log.warning(
                        "decode stream on %s: %s; continuing elsewhere", worker.info.worker_id, why
                    )
            except StreamStalled as err:
                why = f"stalled: {err}"
                log.warning(
                    "decode on %s stalled (%s); continuing elsewhere", worker.info.worker_id, err
                )
                self.metrics.decode_stalls.inc()
                self.suspects.mark(worker.info.worker_id)
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as err:
                why = _why(err)
                if not worker_failed(err):
                    raise
                log.warning(
                    "decode on %s failed (%s); continuing elsewhere",
                    worker.info.worker_id,
                    _why(err),
                )
                self.suspects.mark(worker.info.worker_id)
            finally:
                call.cancel()
                self.pools.end(ticket)
                _end_call_span(span, why, len(produced))
            cause = moves.left(worker.info.worker_id, moved, why)
            trace.span.add_event(
                "decode migration",
                {
                    "tandem.from_worker": worker.info.worker_id,
                    "tandem.reason": why or cause,
                    "tandem.cause": cause,
                    "tandem.with_kv": moves.handle is not None,
                },
            )
            self.metrics.migrated(cause, moves.handle is not None)
        log.warning(
            "request %s: no decode worker left to try (tried %s)",
            request.request_id,
            ", ".join(trace.decode_workers) or "none",
        )
        raise NoWorkerAvailable("no decode worker is available for this model")

    def _note_kv(
        self, response: worker_pb2.DecodeResponse, trace: RequestTrace, span: tracing.AnySpan
    ) -> None:
        if response.kv_source != worker_pb2.KV_SOURCE_UNSPECIFIED:
            trace.kv_source = response.kv_source
            trace.blocks_pulled = response.blocks_pulled
            if span.recording:
                span.set_attributes(
                    {
                        "tandem.kv_source": worker_pb2.KVSource.Name(response.kv_source),
                        "tandem.kv_blocks_pulled": response.blocks_pulled,
                    }
                )
            self.metrics.kv_blocks_pulled.inc(response.blocks_pulled)
            if trace.prefill_worker is None:
                trace.cached_prompt_tokens = response.cached_prompt_tokens

    # --- routing -----------------------------------------------------------------------

    def _routing_request(self, request: ValidatedRequest) -> RoutingRequest:
        """The policies' view of ``request``, with its block hashes when an index is read."""
        hashes: tuple = ()
        block_size = self._block_size() if self._uses_index else None
        if block_size is not None:
            start = time.perf_counter()
            root = root_hash(request.kv_namespace)
            hashes = tuple(hash_blocks(request.prompt_token_ids, block_size, root))
            self.metrics.hashed(time.perf_counter() - start)
        return RoutingRequest(
            request.request_id,
            request.num_prompt_tokens,
            hashes,
            request.priority,
            lora_name=request.lora_name,
            lora_namespace=request.kv_namespace,
        )

    def _without_adapter(
        self, role: WorkerRole, routing: RoutingRequest, exclude: Collection[str]
    ) -> frozenset[str]:
        """The workers of ``role`` a request of an adapter does not go to beside
        ``exclude``: those without it, and cold ones while a warm one is near
        (``routing.adapters``); none for the base model."""
        return excluded_for_adapter(
            self.watcher.workers(role),
            routing.lora_name,
            routing.lora_namespace,
            self.config.lora_cold_load_tokens,
            exclude,
        )

    def _block_size(self) -> int | None:
        """The workers' block size (the KV handshake makes it one per model)."""
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
            workers = self.watcher.workers(role)
            if workers:
                return workers[0].info.capacity.block_size
        return None

    def _pick_first(
        self,
        role: WorkerRole,
        policy: RoutingPolicy,
        routing: RoutingRequest,
        excludes: Sequence[set[str] | frozenset[str]],
        parent: tracing.AnySpan = tracing.NO_SPAN,
    ) -> _Pick | None:
        """A pick from the pool without the first of ``excludes`` that leaves anyone.
        Without suspects, and on the first try, that is simply the first. Traced as
        ``tandem.router.route`` under ``parent``."""
        seen: list[set[str] | frozenset[str]] = []
        with tracing.span("tandem.router.route", parent if parent.recording else None) as span:
            for exclude in excludes:
                if exclude in seen:
                    continue
                seen.append(exclude)
                pick = self._pick(role, policy, routing, exclude)
                if pick is not None:
                    if span.recording:
                        span.set_attributes(
                            {
                                "tandem.role": role.value,
                                "tandem.policy": policy.name,
                                "tandem.worker": pick.worker.info.worker_id,
                                "tandem.matched_blocks": pick.matched_blocks,
                                "tandem.excluded": sorted(exclude),
                            }
                        )
                    return pick
            span.fail(f"no {role.value} worker left")
        return None

    def _pick(
        self,
        role: WorkerRole,
        policy: RoutingPolicy,
        routing: RoutingRequest,
        exclude: set[str] | frozenset[str],
    ) -> _Pick | None:
        """Choose (on the current snapshot) and record; no ``await`` in between."""
        start = time.perf_counter()
        pool = self.pools.view(role, exclude | self._without_adapter(role, routing, exclude))
        if policy.uses_prefix_match and self.indexer is not None and routing.block_hashes:
            routing = dataclasses.replace(
                routing, matched_blocks=self.indexer.overlap(routing.block_hashes)
            )
        choice = policy.choose(routing, pool)
        if choice is None:
            return None
        policy.record(routing, choice)
        matched = routing.matched_blocks.get(choice.info.worker_id, 0)
        self.metrics.decided(time.perf_counter() - start, role, policy.name, matched)
        return _Pick(choice, matched)


async def _within_bounds(
    call: grpc.aio.UnaryStreamCall, clock: StreamClock
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """The call's messages, each within the clock's bound; ``StreamStalled`` past it.
    (``asyncio.timeout`` arms one timer per message: no task is created.)"""
    while True:
        bound = clock.next_bound_s()
        try:
            async with asyncio.timeout(bound):
                response = await call.read()
        except TimeoutError:
            raise StreamStalled(f"no message for {bound:.1f} s") from None
        if response is grpc.aio.EOF:
            return
        clock.observe()
        yield response


def _call_span(
    name: str,
    trace: RequestTrace,
    worker: WorkerRecord,
    attempt: int,
    attributes: dict[str, object] | None = None,
) -> tracing.AnySpan:
    """A span for one call to a worker, under the request's (none when not traced)."""
    if not trace.span.recording:
        return tracing.NO_SPAN
    base = {"tandem.worker": worker.info.worker_id, "tandem.attempt": attempt}
    return tracing.start(name, trace.span, {**base, **(attributes or {})})


def _end_call_span(span: tracing.AnySpan, why: str | None, tokens: int) -> None:
    """End a decode call's span: its tokens so far, failed with ``why`` if it failed."""
    if span.recording:
        span.set_attribute("tandem.tokens", tokens)
        if why is not None:
            span.fail(why)
    span.end()


def _decode_message(
    request: ValidatedRequest,
    produced: list[int],
    handle: worker_pb2.KVHandle | None,
    attempt: int,
) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        # A retry has an id of its own: the worker it goes to may still be tearing down
        # an earlier attempt of the same request.
        request_id=request.request_id if not attempt else f"{request.request_id}~{attempt}",
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=produced,
        sampling=_worker_sampling(request),
        priority=request.priority,
        kv=handle,
        lora_name=request.lora_name or "",
    )


def _why(err: BaseException) -> str:
    return err.code().name if isinstance(err, grpc.aio.AioRpcError) else "call cancelled"


def _worker_sampling(request: ValidatedRequest) -> common_pb2.SamplingParams:
    """Workers handle token-level stops; stop strings are cut by the router's text stream."""
    msg = sampling_to_proto(request.sampling)
    del msg.stop[:]
    msg.include_stop_str_in_output = False
    return msg


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.001, deadline - time.monotonic())
