"""``tandem.v1.Generation``: the public API.

Per request: validate (``INVALID_ARGUMENT``), take an admission slot
(``RESOURCE_EXHAUSTED`` beyond ``max_pending_requests``), stream the orchestrator's
tokens through the request's text stream (detokenization and stop strings happen here,
so workers stay token-in/token-out), and finish with usage. The client's deadline
bounds every worker call; a cancelled client closes the worker streams.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.common import tracing
from tandem.common.metrics import RequestTimer
from tandem.common.registry import WorkerRole
from tandem.common.text_stream import TextStream
from tandem.common.tokenizer import Tokenizer
from tandem.common.wire import FINISH_REASON_TO_PROTO
from tandem.protos import generation_pb2, generation_pb2_grpc
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import NoWorkerAvailable, Orchestrator, RequestTrace
from tandem.router.validation import InvalidRequest, RequestValidator, ValidatedRequest

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The router holds ``max_pending_requests`` already (``RESOURCE_EXHAUSTED``)."""


class WorkerError(Exception):
    """A worker call failed in a way no other worker can make good."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Generator:
    """The request path both public APIs share (gRPC here, OpenAI HTTP in
    ``router.openai_api``): validate, admit, stream the orchestrator's tokens through the
    request's text stream, finish with usage. Raises ``InvalidRequest``, ``Overloaded``,
    ``NoWorkerAvailable`` or ``WorkerError``; closing the stream early cancels the
    request on the workers."""

    def __init__(
        self,
        validator: RequestValidator,
        tokenizer: Tokenizer,
        orchestrator: Orchestrator,
        max_pending_requests: int,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.validator = validator
        self.tokenizer = tokenizer
        self.orchestrator = orchestrator
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics or orchestrator.metrics
        self.num_pending = 0

    def model_info(self) -> generation_pb2.ModelInfo:
        watcher = self.orchestrator.watcher
        return generation_pb2.ModelInfo(
            name=self.validator.model_name,
            max_model_len=self.validator.max_model_len,
            vocab_size=self.validator.vocab_size,
            num_prefill_workers=len(watcher.workers(WorkerRole.PREFILL)),
            num_decode_workers=len(watcher.workers(WorkerRole.DECODE)),
        )

    def admit(
        self, request: generation_pb2.GenerateRequest, parent: tracing.Parent = None
    ) -> ValidatedRequest:
        """Validate (``InvalidRequest``) and check room (``Overloaded``), before any
        answer is sent; traced as ``tandem.router.admit`` under ``parent``."""
        with tracing.span("tandem.router.admit", parent) as span:
            try:
                validated = self.validator.validate(request)
            except InvalidRequest:
                self.metrics.failed("INVALID_ARGUMENT")
                raise
            if self.num_pending >= self.max_pending_requests:
                self.metrics.failed("RESOURCE_EXHAUSTED")
                raise Overloaded(
                    f"the router is at its limit of {self.max_pending_requests} requests in "
                    "flight; retry later"
                )
            if span.recording:
                span.set_attributes(
                    {
                        "tandem.request_id": validated.request_id,
                        "tandem.prompt_tokens": validated.num_prompt_tokens,
                        "tandem.pending_requests": self.num_pending,
                    }
                )
            return validated

    async def stream(
        self, request: ValidatedRequest, deadline: float | None, parent: tracing.Parent = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The answer to an admitted request; ``deadline``: a ``time.monotonic()`` instant.
        Traced as ``tandem.router.request`` under ``parent``, with routing, the prefill and
        each decode attempt inside."""
        self.num_pending += 1
        self.metrics.num_running.inc()
        timer = RequestTimer(self.metrics.requests, request.num_prompt_tokens, time.monotonic)
        finished: str | None = None
        failure = "CANCELLED"  # the client left, unless something below says otherwise
        trace = RequestTrace(span=_request_span(request, parent))
        text = TextStream(self.tokenizer, request.sampling)
        num_tokens = 0
        chunks = self.orchestrator.run(request, trace, deadline)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    num_tokens += len(chunk.token_ids)
                    timer.tokens(len(chunk.token_ids))
                    update = text.push(
                        list(chunk.token_ids), finishing=chunk.finish_reason is not None
                    )
                    finish = "stop" if update.stop_string_hit else chunk.finish_reason
                    response = generation_pb2.GenerateResponse(
                        request_id=request.request_id,
                        token_ids=chunk.token_ids,
                        text=update.new_text,
                        finish_reason=FINISH_REASON_TO_PROTO[finish],
                        logprobs=chunk.logprobs,
                    )
                    if finish is not None:
                        response.usage.prompt_tokens = request.num_prompt_tokens
                        response.usage.completion_tokens = num_tokens
                        response.usage.cached_prompt_tokens = trace.cached_prompt_tokens
                    if finish is not None:
                        finished = finish
                    yield response
                    if finish is not None:
                        return
        except NoWorkerAvailable:
            failure = "UNAVAILABLE"
            raise
        except grpc.aio.AioRpcError as err:
            code = err.code()
            failure = code.name
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise WorkerError(code, "the request's deadline passed before it finished") from err
            raise WorkerError(code, f"worker error: {err.details()}") from err
        finally:
            self.num_pending -= 1
            self.metrics.num_running.dec()
            timer.end(finished)
            if finished is None:
                self.metrics.failed(failure)
            if request.lora_name is not None:
                self.metrics.lora_request(request.lora_name, num_tokens)
            _end_request_span(trace, finished, failure, num_tokens)


def _request_span(request: ValidatedRequest, parent: tracing.Parent) -> tracing.AnySpan:
    if not tracing.enabled():
        return tracing.NO_SPAN
    sampling = request.sampling
    return tracing.start(
        "tandem.router.request",
        parent,
        {
            "tandem.request_id": request.request_id,
            "tandem.prompt_tokens": request.num_prompt_tokens,
            "tandem.max_tokens": sampling.max_tokens,
            "tandem.temperature": sampling.temperature,
            "tandem.structured": sampling.structured is not None,
        },
    )


def _end_request_span(
    trace: RequestTrace, finished: str | None, failure: str, num_tokens: int
) -> None:
    span = trace.span
    if not span.recording:
        return
    span.set_attributes(
        {
            "tandem.completion_tokens": num_tokens,
            "tandem.cached_prompt_tokens": trace.cached_prompt_tokens,
            "tandem.prefill_worker": trace.prefill_worker or "",
            "tandem.decode_workers": list(trace.decode_workers),
            "tandem.finish_reason": finished or failure,
        }
    )
    if finished is None:
        span.fail(failure)
    span.end()


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, generator: Generator) -> None:
        self.generator = generator

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        # A caller's W3C traceparent in the metadata continues its trace.
        parent = tracing.extract(context.invocation_metadata())
        root = tracing.start("tandem.v1.Generation/Generate", parent, server=True)
        try:
            try:
                validated = self.generator.admit(request, root)
            except InvalidRequest as err:
                await _abort(context, root, grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except Overloaded as err:
                await _abort(context, root, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            try:
                async for response in self.generator.stream(validated, deadline, root):
                    yield response
            except NoWorkerAvailable as err:
                await _abort(context, root, grpc.StatusCode.UNAVAILABLE, str(err))
            except WorkerError as err:
                await _abort(context, root, err.code, str(err))
        finally:
            root.end()

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        base = self.generator.model_info()
        models = [base]
        for name in sorted(self.generator.validator.adapters()):
            adapter = generation_pb2.ModelInfo()
            adapter.CopyFrom(base)
            adapter.name, adapter.parent = name, base.name
            models.append(adapter)
        return generation_pb2.ListModelsResponse(models=models)


async def _abort(
    context: grpc.aio.ServicerContext, span: tracing.AnySpan, code: grpc.StatusCode, message: str
) -> None:
    span.fail(f"{code.name}: {message}")
    await context.abort(code, message)
