"""``tandem.v1.PrefillWorker``: prefill a prompt, sample its first token, lease its KV.

Block ownership: while a lease is live the request's blocks belong to it (the engine
holds them as ``PREFILLED``; the KV sender only reads them). The lease ends — by the
decode worker's ``ReleaseLease`` once it has pulled, by ``Abort``, or by expiry — and
only then are the blocks handed back to the engine's prefix cache. A lease being read
by a pull ends when that pull finishes (``LeaseTable`` pins), never under it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import grpc

from tandem.common import tracing
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.kv_events.wire import snapshot_to_proto
from tandem.common.lora_service import LoRAAdmin
from tandem.common.metrics import RequestTimer
from tandem.common.sampling_params import SamplingParams
from tandem.common.wire import FINISH_REASON_TO_PROTO, logprobs_to_proto, sampling_from_proto
from tandem.common.worker_load import worker_status
from tandem.common.worker_metrics import WorkerMetrics
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.outputs import RequestDelta
from tandem.engine.request import PrefillMode
from tandem.kvtransfer.held import HeldKV
from tandem.kvtransfer.sender import KVSender
from tandem.protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillService(LoRAAdmin, worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        held: HeldKV,
        sender: KVSender,
        worker_id: str,
        metrics: WorkerMetrics,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """``held``: the leases on prefilled KV. ``kv_events``: the publisher of this
        worker's prefix-cache events, whose numbering ``ListCachedBlocks`` snapshots are
        stamped with."""
        self.engine = engine
        self.metrics = metrics
        self.kv_events = kv_events
        self.held = held
        self.sender = sender
        self.worker_id = worker_id
        self.num_requests = 0

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        parent = tracing.extract(context.invocation_metadata())
        attributes = {"tandem.request_id": request.request_id, "tandem.worker": self.worker_id}
        with tracing.span("tandem.prefill", parent, attributes, server=True) as span:
            response = await self._prefill(request, context, span)
            if span.recording:
                span.set_attributes(
                    {
                        "tandem.prompt_tokens": len(request.prompt_token_ids),
                        "tandem.cached_prompt_tokens": response.cached_prompt_tokens,
                        "tandem.kv_blocks_leased": response.kv.num_blocks,
                    }
                )
            return response

    async def _prefill(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        span: tracing.AnySpan,
    ) -> worker_pb2.PrefillResponse:
        self.num_requests += 1
        num_prompt = len(request.prompt_token_ids)
        timer = RequestTimer(self.metrics.requests, num_prompt, time.monotonic)
        try:
            params = sampling_from_proto(request.sampling)
            delta = await self._first_delta(request, params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        timer.tokens(len(delta.new_token_ids))
        timer.end(delta.finish_reason or "prefilled")
        self.metrics.queue_time.observe(delta.queued_s)
        span.set_attribute("tandem.queue_s", delta.queued_s)
        self.metrics.observe_prefix(num_prompt, delta.num_cached_tokens)
        response = worker_pb2.PrefillResponse(
            first_token_id=delta.new_token_ids[0],
            finish_reason=FINISH_REASON_TO_PROTO[delta.finish_reason],
            cached_prompt_tokens=delta.num_cached_tokens,
        )
        if delta.new_logprobs:
            response.first_logprobs.CopyFrom(logprobs_to_proto(delta.new_logprobs)[0])
        if delta.prefilled:
            response.kv.CopyFrom(await self._lease(request))
        return response

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        rid = request.request_id
        if self.held.holds(rid):  # prefilled: end the lease (a pull in progress finishes first)
            return worker_pb2.AbortResponse(found=self.held.abort(rid))
        return worker_pb2.AbortResponse(
            found=await self.engine.call(lambda e: e.abort_request(rid))
        )

    async def GetStatus(
        self, request: worker_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = worker_status(self.engine.load, self.worker_id, "prefill", self.num_requests)
        status.num_leases = len(self.held)
        status.kv_blocks_sent = getattr(self.sender, "sender", self.sender).blocks_sent
        return status

    async def ListCachedBlocks(
        self, request: worker_pb2.ListCachedBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CachedBlocks:
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off")
        return snapshot_to_proto(await self.kv_events.snapshot_of(self.engine))

    async def _first_delta(
        self, request: worker_pb2.PrefillRequest, params: SamplingParams
    ) -> RequestDelta:
        stream = self.engine.generate(
            list(request.prompt_token_ids),
            params,
            request.request_id,
            priority=request.priority,
            prefill_mode=PrefillMode.HAND_OFF,
            lora_name=request.lora_name or None,
        )
        async with contextlib.aclosing(stream):
            async for delta in stream:
                return delta
        raise RuntimeError("the engine ended a prefill without a token")

    async def _lease(self, request: worker_pb2.PrefillRequest) -> worker_pb2.KVHandle:
        rid = request.request_id
        block_ids = await self.engine.call(lambda e: e.prefilled_block_ids(rid))
        return self.held.grant(rid, block_ids, len(request.prompt_token_ids))
