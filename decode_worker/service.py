"""``tandem.v1.DecodeWorker``: continue a request from its prefill, stream its tokens.

A request with a KV handle enters the engine as ``REMOTE``: the engine allocates
blocks for the prompt tokens its prefix cache lacks and asks for a pull; the pull runs
here, on the event loop, through the ``KVReceiver``; the pulled bytes are written into
the blocks on the engine thread. Any failure (timeout, dead prefill worker, refused
lease) falls back to computing the prompt locally, so the stream never breaks. The
lease is released (or renewed while the request waits for admission) from here too.

A decode worker also hands running streams to its peers (live migration): ``migrate``
takes the sequences off the engine, which keeps their KV blocks; each stream's last
message carries a ``handoff`` — a lease on those blocks, served by this worker's own
``KVTransfer`` service (``HeldKV``) — and the router continues the stream on another
decode worker, which pulls only the blocks it lacks. ``Migrate`` does it on request
(rebalancing); ``drain`` does it to every stream on shutdown, at once when a peer is
registered (``--drain-migrate-after``), else once ``--drain-timeout`` runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc

from tandem.common import tracing
from tandem.common.faults import fault_at
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.kv_events.wire import snapshot_to_proto
from tandem.common.lora_service import LoRAAdmin
from tandem.common.metrics import RequestTimer
from tandem.common.wire import (
    FINISH_REASON_TO_PROTO,
    MIGRATION_CAUSE_NAMES,
    logprobs_to_proto,
    sampling_from_proto,
)
from tandem.common.worker_load import worker_status
from tandem.common.worker_metrics import WorkerMetrics
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.llm_engine import Handover
from tandem.engine.request import PrefillMode
from tandem.engine.scheduler import KVPull
from tandem.kvtransfer.blocks import unpack_blocks
from tandem.kvtransfer.errors import KVPullFailed, LeaseCallFailed
from tandem.kvtransfer.held import HeldKV
from tandem.kvtransfer.receiver import KVReceiver
from tandem.protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

HANDOFF_WAIT_S = 10.0
"""How long a draining worker waits, after handing its streams over, for the peers to
pull the KV (their leases end) before it stops serving ``KVTransfer``."""
POLL_S = 0.05
PEER_SETTLE_S = 1.0
"""How long a draining worker waits before it counts its peers (see ``drain``)."""


@dataclass
class _Live:
    """A stream being served here."""

    cause: int = worker_pb2.MIGRATION_CAUSE_UNSPECIFIED
    """Set once the stream is being handed over."""


@dataclass
class _PendingPull:
    handle: worker_pb2.KVHandle
    renewer: asyncio.Task[None]
    started: bool = False
    source: int = worker_pb2.KV_SOURCE_UNSPECIFIED
    blocks_pulled: int = 0
    ranks_pull_id: int | None = None
    """Tensor-parallel: the pull the other ranks staged, until written or dropped."""
    span: tracing.AnySpan = tracing.NO_SPAN
    """The decode's span, the parent of the pull's (the engine starts the pull from its
    own thread, outside the call)."""


def _quietly(fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


class DecodeService(LoRAAdmin, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        held: HeldKV,
        worker_id: str,
        pull_timeout_s: float,
        metrics: WorkerMetrics,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """``held``: leases on the KV of streams handed to peers. ``kv_events``: the
        publisher of this worker's prefix-cache events, whose numbering
        ``ListCachedBlocks`` snapshots are stamped with."""
        self.engine = engine
        self.held = held
        self.draining = False
        """Set by ``drain``: new streams are refused (``UNAVAILABLE``)."""
        self._live: dict[str, _Live] = {}
        self.metrics = metrics
        self.kv_events = kv_events
        self.receiver = receiver
        self.worker_id = worker_id
        self.pull_timeout_s = pull_timeout_s
        self.num_fallbacks = 0
        self.num_requests = 0
        self._pulls: dict[str, _PendingPull] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._kv_caches = engine.engine.runner.kv_caches
        self._fault = fault_at("decode.stream")
        self._dropping = self._fault is not None and self._fault.action == "drop"

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        parent = tracing.extract(context.invocation_metadata())
        span = tracing.start(
            "tandem.decode",
            parent,
            {"tandem.request_id": request.request_id, "tandem.worker": self.worker_id},
            server=True,
        )
        tokens = 0
        try:
            async for response in self._decode(request, context, span):
                tokens += len(response.token_ids)
                yield response
        except BaseException as err:
            if not isinstance(err, GeneratorExit):
                span.record_exception(err)
            raise
        finally:
            if span.recording:
                span.set_attribute("tandem.tokens", tokens)
            span.end()

    async def _decode(
        self,
        request: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
        span: tracing.AnySpan,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        rid = request.request_id
        self.num_requests += 1
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id} is shutting down"
            )
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        remote = request.HasField("kv")
        if remote:
            self._pulls[rid] = _PendingPull(
                request.kv, asyncio.create_task(self._renew(request.kv)), span=span
            )
        if span.recording:
            span.set_attributes(
                {
                    "tandem.prompt_tokens": len(request.prompt_token_ids),
                    "tandem.resumed_tokens": len(request.output_token_ids),
                    "tandem.kv_handle": remote,
                }
            )
        stream = self.engine.generate(
            list(request.prompt_token_ids),
            params,
            rid,
            priority=request.priority,
            output_token_ids=list(request.output_token_ids),
            prefill_mode=PrefillMode.REMOTE if remote else PrefillMode.LOCAL,
            num_remote_tokens=request.kv.num_tokens if remote else 0,
            lora_name=request.lora_name or None,
        )
        first = True
        finished = None
        timer = RequestTimer(self.metrics.requests, len(request.prompt_token_ids), time.monotonic)
        live = self._live.setdefault(rid, _Live())
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    if delta.handover is not None:
                        yield self._handoff(rid, delta.handover, live.cause, span)
                        return
                    timer.tokens(len(delta.new_token_ids))
                    finished = delta.finish_reason
                    response = worker_pb2.DecodeResponse(
                        token_ids=delta.new_token_ids,
                        logprobs=logprobs_to_proto(delta.new_logprobs),
                        finish_reason=FINISH_REASON_TO_PROTO[delta.finish_reason],
                    )
                    if first:
                        self._describe_kv(response, rid, delta.num_cached_tokens)
                        self.metrics.queue_time.observe(delta.queued_s)
                        if span.recording:
                            span.add_event("first token")
                            span.set_attributes(
                                {
                                    "tandem.queue_s": delta.queued_s,
                                    "tandem.cached_prompt_tokens": delta.num_cached_tokens,
                                    "tandem.kv_source": worker_pb2.KVSource.Name(
                                        response.kv_source
                                    ),
                                }
                            )
                        if not remote:
                            self.metrics.observe_prefix(
                                len(request.prompt_token_ids), delta.num_cached_tokens
                            )
                        first = False
                    if self._fault is not None and self._fault.fire() and self._dropping:
                        return  # fault point decode.stream, drop: end without a finish
                    yield response
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        finally:
            timer.end(finished)
            self._forget(rid)
            if self._live.get(rid) is live:
                del self._live[rid]

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        rid = request.request_id
        return worker_pb2.AbortResponse(
            found=await self.engine.call(lambda e: e.abort_request(rid))
        )

    async def Migrate(
        self, request: worker_pb2.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.MigrateResponse:
        if not request.request_ids and not request.num_blocks and not request.num_streams:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "name request_ids, or a num_blocks to free or a num_streams to move",
            )
        cause = request.cause or worker_pb2.MIGRATION_CAUSE_REQUESTED
        if cause not in MIGRATION_CAUSE_NAMES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown cause {cause}")
        held = await self._blocks_held()
        if request.request_ids:
            chosen = [rid for rid in request.request_ids if rid in self._live]
        else:  # the fewest streams that free enough (and are enough): the largest first
            chosen, total = [], 0
            for rid in sorted(held, key=held.__getitem__, reverse=True):
                if total >= request.num_blocks and len(chosen) >= request.num_streams:
                    break
                chosen.append(rid)
                total += held[rid]
        moved = await self.migrate(chosen, cause)
        return worker_pb2.MigrateResponse(
            request_ids=moved, num_blocks=sum(held.get(rid, 0) for rid in moved)
        )

    async def GetStatus(
        self, request: worker_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = worker_status(self.engine.load, self.worker_id, "decode", self.num_requests)
        status.kv_blocks_received = self.receiver.stats.blocks
        status.num_leases = len(self.held)
        status.num_fallbacks = self.num_fallbacks
        return status

    async def ListCachedBlocks(
        self, request: worker_pb2.ListCachedBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CachedBlocks:
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off")
        return snapshot_to_proto(await self.kv_events.snapshot_of(self.engine))

    # --- handing streams over -----------------------------------------------------------

    async def migrate(self, request_ids: Iterable[str], cause: int) -> list[str]:
        """Hand these streams to peers (see the module doc); returns those now handing
        over (streams unknown here, finished, or already moving are skipped)."""
        chosen = [rid for rid in request_ids if rid in self._live and not self._live[rid].cause]
        for rid in chosen:
            self._live[rid].cause = cause
        moved = await self.engine.migrate_out(chosen) if chosen else {}
        for rid in chosen:
            if rid not in moved and rid in self._live:
                self._live[rid].cause = worker_pb2.MIGRATION_CAUSE_UNSPECIFIED
        return [rid for rid in chosen if rid in moved]

    async def drain(
        self, drain_s: float, migrate_after_s: float, count_peers: Callable[[], Awaitable[int]]
    ) -> None:
        """Shut down without losing or changing a stream: refuse new ones, let those in
        flight finish for ``migrate_after_s`` when a peer decode worker is registered
        (else for ``drain_s``), hand the rest over with their KV, and wait (up to
        ``HANDOFF_WAIT_S``) for the peers to pull it."""
        self.draining = True
        if not self._live:
            return
        wait_s = drain_s
        if migrate_after_s < drain_s:
            # Peers told to stop at the same moment (a scale-down of several) leave the
            # registry within this; counted before, they would be handed streams they
            # refuse, and the streams would have nowhere to go.
            await asyncio.sleep(PEER_SETTLE_S)
            if await count_peers() > 0:
                wait_s = max(0.0, migrate_after_s - PEER_SETTLE_S)
        log.info(
            "draining: %d streams; up to %.1f s for them to finish here", len(self._live), wait_s
        )
        await _until(lambda: not self._live, wait_s)
        if self._live:
            moved = await self.migrate(list(self._live), worker_pb2.MIGRATION_CAUSE_DRAIN)
            log.info("draining: handing %d streams to other decode workers", len(moved))
        await _until(lambda: not self._live and not len(self.held), HANDOFF_WAIT_S)
        if self._live or len(self.held):
            log.warning(
                "draining: %d streams and %d handed-over KV leases still open after %.0f s",
                len(self._live),
                len(self.held),
                HANDOFF_WAIT_S,
            )

    def _handoff(
        self, rid: str, handover: Handover, cause: int, span: tracing.AnySpan
    ) -> worker_pb2.DecodeResponse:
        """The last message of a stream handed over: its cause and the lease on its KV."""
        cause = cause or worker_pb2.MIGRATION_CAUSE_REQUESTED
        response = worker_pb2.DecodeResponse(migration_cause=cause)
        if handover.block_ids:
            response.handoff.CopyFrom(self.held.grant(rid, handover.block_ids, handover.num_tokens))
        self.metrics.labelled(self.metrics.migrations_out, cause=MIGRATION_CAUSE_NAMES[cause]).inc()
        if span.recording:
            span.add_event(
                "handed over",
                {
                    "tandem.cause": MIGRATION_CAUSE_NAMES[cause],
                    "tandem.kv_tokens": handover.num_tokens,
                },
            )
        return response

    async def _blocks_held(self) -> dict[str, int]:
        """KV blocks each running stream holds here."""
        live = list(self._live)

        def read(engine) -> dict[str, int]:
            held = {}
            for rid in live:
                request = engine.requests.get(rid)
                if request is not None:
                    held[rid] = engine.kv_cache.num_blocks_held(request)
            return held

        return await self.engine.call(read)

    # --- the pull ----------------------------------------------------------------------

    async def pull(self, order: KVPull) -> None:
        """Called by the engine for each ``REMOTE`` request it admitted; always ends the
        pull with ``finish_kv_pull``, successful or not."""
        rid = order.request.request_id
        pending = self._pulls.get(rid)
        fill = None
        if pending is not None:
            pending.started = True
            pending.renewer.cancel()
            fill = await self._fetch(pending, order)
        filled = await self.engine.call(lambda e: e.finish_kv_pull(rid, fill))
        pull_id = pending.ranks_pull_id if pending is not None else None
        if pull_id is not None and not filled:  # the other ranks drop what they staged
            await asyncio.to_thread(_quietly, self.receiver.ranks.discard, pull_id)

    async def _fetch(self, pending: _PendingPull, order: KVPull):
        handle = pending.handle
        indices = list(range(order.first_block, order.first_block + len(order.block_ids)))
        span = tracing.start(
            "tandem.kv.pull",
            pending.span if pending.span.recording else None,
            {"tandem.prefill_worker": handle.prefill_worker_id, "tandem.kv_blocks": len(indices)},
        )
        try:
            packed = None
            if indices:
                start = time.monotonic()
                packed, pending.ranks_pull_id = await self.receiver.pull_ranked(
                    handle.kv_endpoint, handle.lease_id, indices, self.pull_timeout_s
                )
                self.metrics.kv_pull_seconds.observe(time.monotonic() - start)
                span.set_attribute("tandem.kv_bytes", packed.nbytes)
        except KVPullFailed as err:
            log.warning(
                "KV pull for %s failed, prefilling locally: %s", order.request.request_id, err
            )
            self.num_fallbacks += 1
            self.metrics.kv_fallbacks.inc()
            pending.source = worker_pb2.KV_SOURCE_FALLBACK
            span.set_attribute("tandem.fallback", True)
            span.fail(f"falling back to a local prefill: {err}")
            return None
        finally:
            self._release_later(handle)
            span.end()
        pending.source, pending.blocks_pulled = worker_pb2.KV_SOURCE_PULLED, len(indices)
        if packed is None:
            return lambda block_ids: None
        runner, pull_id = self.engine.engine.runner, pending.ranks_pull_id

        def fill(block_ids: list[int]) -> None:  # on the engine thread
            unpack_blocks(self._kv_caches, block_ids, packed)
            if pull_id is not None:
                runner.unpack_on_ranks(pull_id, block_ids)

        return fill

    async def _renew(self, handle: worker_pb2.KVHandle) -> None:
        """Keep the lease alive while the request waits here for admission."""
        while True:
            await asyncio.sleep(max(handle.lease_ttl_s / 3, 0.05))
            with contextlib.suppress(LeaseCallFailed):
                await self.receiver.renew(handle.kv_endpoint, handle.lease_id)

    def _release_later(self, handle: worker_pb2.KVHandle) -> None:
        async def release() -> None:
            with contextlib.suppress(LeaseCallFailed):
                await self.receiver.release(handle.kv_endpoint, handle.lease_id)

        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _describe_kv(self, response: worker_pb2.DecodeResponse, rid: str, cached: int) -> None:
        pending = self._pulls.get(rid)
        response.kv_source = pending.source if pending else worker_pb2.KV_SOURCE_LOCAL_PREFILL
        response.blocks_pulled = pending.blocks_pulled if pending else 0
        response.cached_prompt_tokens = cached

    def _forget(self, rid: str) -> None:
        """The stream ended; a lease never pulled (request aborted first) is released."""
        pending = self._pulls.pop(rid, None)
        if pending is not None:
            pending.renewer.cancel()
            if not pending.started:
                self._release_later(pending.handle)


async def _until(done: Callable[[], bool], timeout_s: float) -> None:
    """Wait until ``done()`` or ``timeout_s`` passes (polled: the conditions are cheap)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
