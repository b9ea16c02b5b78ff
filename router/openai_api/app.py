"""The OpenAI-compatible HTTP API (``tandem router --http-port``): ``/v1/completions``,
``/v1/chat/completions`` (with ``stream: true`` as server-sent events), ``/v1/models``,
vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, and ``/health``, on Starlette
through FastAPI, served by uvicorn in the router's own event loop. Every request takes
the same path as a gRPC ``Generate`` (``router.service.Generator``): validation,
admission, routing, fail-over.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad field (named in ``param``), 401 without a valid API key, 404 for an unknown model,
429 over the admission limit or a key's rate limit (with ``Retry-After``), 503 when no
worker can serve. A client that disconnects cancels its request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.common import tracing
from tandem.common.wire import FINISH_REASON_FROM_PROTO
from tandem.protos import common_pb2, generation_pb2
from tandem.router.auth import ApiKeys
from tandem.router.lora_admin import LoRAFleet, LoRAUpdateError
from tandem.router.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    Unsupported,
)
from tandem.router.openai_api.tools import OutputParser, ToolUse, assemble
from tandem.router.orchestrator import NoWorkerAvailable
from tandem.router.rate_limit import RateLimiter
from tandem.router.service import Generator, Overloaded, WorkerError
from tandem.router.validation import InvalidRequest, ValidatedRequest

_DISCONNECT_POLL_S = 0.2


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}},
            status_code=self.status,
            headers=self.headers,
        )


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def make_app(
    generator: Generator,
    api_keys: ApiKeys | None = None,
    limiter: RateLimiter | None = None,
    is_ready: Callable[[], bool] = lambda: True,
    tool_parser: str | None = None,
    lora_fleet: LoRAFleet | None = None,
) -> FastAPI:
    """The app over ``generator``; ``tool_parser`` (``--tool-call-parser``, given with
    ``--enable-auto-tool-choice``) turns on ``tool_choice: auto``; ``lora_fleet`` turns
    on loading and unloading LoRA adapters at run time."""
    # The OpenAPI schema at /openapi.json, as vLLM serves it (no docs pages: they load
    # scripts from a CDN).
    version = importlib.metadata.version("tandem")
    app = FastAPI(title="Tandem", version=version, docs_url=None, redoc_url=None)
    tokens = _TokenText(generator)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own answers (an unknown path, a wrong method) in OpenAI's shape."""
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            error.status_code, "invalid_request_error"
        )
        message = f"{request.method} {request.url.path}: {error.detail}"
        return ApiError(error.status_code, message, kind, headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = _location(first.get("loc", ()))
        return _invalid(
            f"{where or 'body'}: {first.get('msg', 'invalid request')}", where
        ).response()

    async def authorize(request: Request) -> None:
        if api_keys is None:
            return
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        if not key:
            raise ApiError(
                401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error"
            )
        if not api_keys.allows(key):
            raise ApiError(401, "invalid API key", "authentication_error")
        if limiter is not None:
            wait_ms = await limiter.take(key)
            if wait_ms is not None:
                raise ApiError(
                    429,
                    f"rate limit of {limiter.limit.rate:g} requests/s for this API key "
                    f"reached; retry in {wait_ms} ms",
                    "rate_limit_error",
                    headers={"Retry-After": str(max(1, -(-wait_ms // 1000)))},
                )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_ready() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The router's Prometheus metrics, as on ``--metrics-port`` (open, like health)."""
        body = prometheus_client.generate_latest(generator.metrics.registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await authorize(request)
        info = generator.model_info()
        card = {"object": "model", "created": 0, "owned_by": "tandem"}
        card["max_model_len"] = info.max_model_len
        base = [{"id": n, **card, "root": info.name} for n in generator.validator.served_names]
        adapters = sorted(generator.validator.adapters())
        loras = [{"id": n, **card, "root": n, "parent": info.name} for n in adapters]
        return {"object": "list", "data": base + loras}

    _add_token_endpoints(app, generator, authorize, tokens)
    if lora_fleet is not None:
        _add_lora_endpoints(app, lora_fleet, authorize)

    async def answer(
        request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> Response:
        await authorize(request)
        tools = None
        try:
            if isinstance(body, ChatCompletionRequest):
                tools = body.tool_use(tool_parser)
                choices = body.requests(tools)
            else:
                choices = body.requests()
        except Unsupported as err:
            raise _invalid(str(err), err.param) from None
        if not chat:  # one list of choices per prompt of the batch
            choices = [c for per_prompt in choices for c in per_prompt]
        prefix = "chatcmpl" if chat else "cmpl"
        answer = _Answer(generator, tokens, prefix, body.model, chat=chat, n=body.n, tools=tools)
        # A caller's W3C traceparent header continues its trace; the span ends with the
        # answer (a stream's last event).
        answer.span = tracing.start(
            f"POST {request.url.path}", tracing.extract(request.headers), server=True
        )
        try:
            admitted = answer.admit(choices)
            if isinstance(body, CompletionRequest) and body.echo:
                answer.echo = [_prompt_text(generator, r) for r in choices]
            if body.stream:
                include, continuous = body.include_usage, body.continuous_usage
                return await answer.stream(request, admitted, include, continuous)
            return await answer.whole(request, admitted)
        except BaseException as err:
            answer.span.fail(str(err) or type(err).__name__)
            answer.span.end()
            raise

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await answer(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await answer(request, body, chat=True)

    return app


_LORA_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
}


def _add_lora_endpoints(
    app: FastAPI, fleet: LoRAFleet, authorize: Callable[[Request], Awaitable[None]]
) -> None:
    """vLLM's runtime adapter endpoints, over every worker of the fleet."""

    async def fleet_call(call: Awaitable[int]) -> int:
        try:
            return await call
        except LoRAUpdateError as err:
            status, kind = _LORA_STATUS.get(err.code, (503, "service_unavailable_error"))
            raise ApiError(status, str(err), kind, "lora_name") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        await authorize(request)
        count = await fleet_call(fleet.load(body.lora_name, body.lora_path))
        return Response(
            f"Success: LoRA adapter '{body.lora_name}' added successfully on {count} workers.",
            media_type="text/plain",
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        await authorize(request)
        count = await fleet_call(fleet.unload(body.lora_name))
        return Response(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully from {count} workers.",
            media_type="text/plain",
        )


def _add_token_endpoints(
    app: FastAPI,
    generator: Generator,
    authorize: Callable[[Request], Awaitable[None]],
    tokens: _TokenText,
) -> None:
    """vLLM's ``/tokenize``, ``/detokenize`` and ``/version``."""

    def served(model: str) -> None:
        validator = generator.validator
        if model and model not in validator.served_names and model not in validator.adapters():
            raise ApiError(404, f"the model {model!r} does not exist", "not_found_error", "model")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        await authorize(request)
        try:
            proto = body.request()
            served(body.model)
            ids = generator.validator.tokenize(proto, body.add_special_tokens)
        except Unsupported as err:
            raise _invalid(str(err), err.param) from None
        except InvalidRequest as err:
            param = _param(err.field)
            raise _invalid(f"{param} {err.problem}", param) from None
        return {
            "count": len(ids),
            "max_model_len": generator.validator.max_model_len,
            "tokens": ids,
            "token_strs": [tokens(i) for i in ids] if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        await authorize(request)
        served(body.model)
        try:
            return {"prompt": generator.validator.detokenize(body.tokens)}
        except InvalidRequest as err:
            raise _invalid(str(err), err.field) from None

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("tandem")}


class _TokenText:
    """Token strings for logprobs (each token decoded alone, special tokens kept)."""

    def __init__(self, generator: Generator) -> None:
        self._tokenizer = generator.tokenizer

    def __call__(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class _Choice:
    """What one choice has produced so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[common_pb2.TokenLogprobs] = []
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.usage: generation_pb2.Usage | None = None


class _Answer:
    """One OpenAI request: its choices' Tandem requests, answered whole or streamed."""

    def __init__(
        self,
        generator: Generator,
        tokens: _TokenText,
        prefix: str,
        model: str,
        chat: bool,
        n: int,
        tools: ToolUse | None = None,
    ) -> None:
        self.n = n
        self.tools = tools
        self.span: tracing.AnySpan = tracing.NO_SPAN
        """The HTTP request's span, the parent of each choice's."""
        self.echo: list[str] | None = None
        """Per choice, the prompt text a completion with ``echo`` starts with."""
        self.generator = generator
        self.tokens = tokens
        self.chat = chat
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.requested_model = model
        self.model = model or generator.validator.model_name
        self.logprobs_wanted = False

    def admit(self, requests: Sequence[generation_pb2.GenerateRequest]) -> list[ValidatedRequest]:
        admitted = []
        for request in requests:
            request.request_id = f"{self.id}-{len(admitted)}"
            request.model = self.requested_model
            try:
                admitted.append(self.generator.admit(request, self.span))
            except InvalidRequest as err:
                if err.field == "model":
                    raise ApiError(
                        404,
                        f"the model {request.model!r} does not exist",
                        "not_found_error",
                        "model",
                    ) from None
                param = _param(err.field)
                raise _invalid(f"{param} {err.problem}", param) from None
            except Overloaded as err:
                raise ApiError(
                    429, str(err), "rate_limit_error", headers={"Retry-After": "1"}
                ) from None
        self.logprobs_wanted = any(r.sampling.logprobs is not None for r in admitted)
        return admitted

    # --- whole answers -----------------------------------------------------------------

    async def whole(self, request: Request, admitted: list[ValidatedRequest]) -> JSONResponse:
        choices = [_Choice() for _ in admitted]
        work = asyncio.ensure_future(
            asyncio.gather(*(self._collect(r, c) for r, c in zip(admitted, choices, strict=True)))
        )
        try:
            await _unless_disconnected(request, work)
        except _Failure as failure:
            raise failure.error from None
        self.span.end()
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._whole_choice(i, c) for i, c in enumerate(choices)],
                "usage": self._usage({i: c.usage for i, c in enumerate(choices)}),
            }
        )

    async def _collect(self, request: ValidatedRequest, choice: _Choice) -> None:
        async for response in _guarded(self.generator.stream(request, None, self.span)):
            choice.text.append(response.text)
            choice.token_ids += response.token_ids
            choice.logprobs += response.logprobs
            if response.finish_reason:
                choice.finish = FINISH_REASON_FROM_PROTO[response.finish_reason]
                choice.usage = response.usage

    def _whole_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        logprobs = (
            self._logprobs(choice.token_ids, choice.logprobs) if self.logprobs_wanted else None
        )
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = choice.finish
            parser = None if self.tools is None else self.tools.parser()
            if parser is not None:
                settled = parser.feed(text).add(parser.finish())
                if settled.calls:
                    message["content"] = settled.content or None
                    message["tool_calls"] = assemble(settled.calls)
                    finish = self.tools.finish_reason(finish, parser.num_calls)
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        if self.echo is not None:
            text = self.echo[index] + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish}

    # --- streams -----------------------------------------------------------------------

    async def stream(
        self,
        request: Request,
        admitted: list[ValidatedRequest],
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> Response:
        """Server-sent events; the first event is awaited before answering, so a request
        no worker can take gets its HTTP status rather than a broken stream."""
        queue: asyncio.Queue[tuple[int, generation_pb2.GenerateResponse | _Failure | None]]
        queue = asyncio.Queue()

        async def pump(index: int, validated: ValidatedRequest) -> None:
            try:
                stream = self.generator.stream(validated, None, self.span)
                async for response in _guarded(stream):
                    await queue.put((index, response))
            except _Failure as failure:
                await queue.put((index, failure))
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(admitted)]
        first = await queue.get()
        if isinstance(first[1], _Failure):
            for task in tasks:
                task.cancel()
            raise first[1].error
        choices = [
            _StreamedChoice(self, i, r.num_prompt_tokens, continuous_usage)
            for i, r in enumerate(admitted)
        ]

        async def events() -> AsyncIterator[str]:
            open_streams, usages = len(tasks), {}
            item: tuple[int, Any] | None = first
            try:
                for choice in choices:  # a chat's role, or a completion's echo
                    if (opening := choice.opening()) is not None:
                        yield opening
                while open_streams:
                    index, response = item if item is not None else await queue.get()
                    item = None
                    if response is None:
                        open_streams -= 1
                        continue
                    if isinstance(response, _Failure):
                        yield _error_event(response.error)
                        return
                    if response.finish_reason:
                        usages[index] = response.usage
                    if (event := choices[index].event(response)) is not None:
                        yield event
                if include_usage:
                    yield _sse(
                        {
                            "id": self.id,
                            "object": self._chunk_object,
                            "created": self.created,
                            "model": self.model,
                            "choices": [],
                            "usage": self._usage(usages),
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                self.span.end()
                for task in tasks:
                    task.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    def _tool_delta(
        self, parser: OutputParser, text: str, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A streamed chat delta through the tool parser: the content and call pieces it
        settled (everything at the finish)."""
        settled = parser.feed(text)
        if finish is not None:
            settled.add(parser.finish())
            assert self.tools is not None
            finish = self.tools.finish_reason(finish, parser.num_calls)
        delta: dict[str, Any] = {}
        if settled.content:
            delta["content"] = settled.content
        if settled.calls:
            delta["tool_calls"] = [call.openai() for call in settled.calls]
        return delta, finish

    def _usage(self, usages: dict[int, generation_pb2.Usage | None]) -> dict[str, Any]:
        return _usage(usages, self.n)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _event(
        self,
        index: int,
        content: Any,
        logprobs: Any,
        finish: str | None,
        usage: dict[str, int] | None = None,
    ) -> str:
        key = "delta" if self.chat else "text"
        choice = {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
        chunk = {
            "id": self.id,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage is not None:
            chunk["usage"] = usage
        return _sse(chunk)

    # --- logprobs ----------------------------------------------------------------------

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        pairs = list(zip(token_ids, logprobs, strict=False))
        if self.chat:
            return {
                "content": [
                    {
                        "token": self.tokens(t),
                        "logprob": lp.logprob,
                        "bytes": list(self.tokens(t).encode()),
                        "top_logprobs": [
                            {
                                "token": self.tokens(x.token_id),
                                "logprob": x.logprob,
                                "bytes": list(self.tokens(x.token_id).encode()),
                            }
                            for x in lp.top
                        ],
                    }
                    for t, lp in pairs
                ]
            }
        offsets, position = [], 0
        for t, _ in pairs:
            offsets.append(position)
            position += len(self.tokens(t))
        return {
            "tokens": [self.tokens(t) for t, _ in pairs],
            "token_logprobs": [lp.logprob for _, lp in pairs],
            "top_logprobs": [
                {self.tokens(x.token_id): x.logprob for x in lp.top} for _, lp in pairs
            ],
            "text_offset": offsets,
        }


def _prompt_text(generator: Generator, request: generation_pb2.GenerateRequest) -> str:
    """What ``echo`` repeats: the prompt as sent, or a token-id prompt's text."""
    if request.WhichOneof("input") == "prompt":
        return request.prompt
    return generator.tokenizer.decode(list(request.token_ids.ids))


class _StreamedChoice:
    """One choice of a streamed answer: its tool parser and the tokens it has sent."""

    def __init__(self, answer: _Answer, index: int, prompt_tokens: int, continuous: bool) -> None:
        self.answer, self.index = answer, index
        self.parser = None if answer.tools is None else answer.tools.parser()
        self.prompt_tokens, self.continuous = prompt_tokens, continuous
        self.generated = 0

    def opening(self) -> str | None:
        """The event before any token: a chat's role, or a completion's echo."""
        answer = self.answer
        if answer.chat:
            content: Any = {"role": "assistant", "content": ""}
        elif answer.echo is not None:
            content = answer.echo[self.index]
        else:
            return None
        return answer._event(self.index, content, None, None, self._usage())

    def event(self, response: generation_pb2.GenerateResponse) -> str | None:
        """The event for a worker's response; ``None`` while the tool parser holds its
        text back (it may be the start of a call)."""
        answer = self.answer
        finish = FINISH_REASON_FROM_PROTO[response.finish_reason]
        logprobs = None
        if answer.logprobs_wanted:
            logprobs = answer._logprobs(list(response.token_ids), list(response.logprobs))
        self.generated += len(response.token_ids)
        if self.parser is None:
            content: Any = {"content": response.text} if answer.chat else response.text
        else:
            content, finish = answer._tool_delta(self.parser, response.text, finish)
            if not content and logprobs is None and finish is None:
                return None
        return answer._event(self.index, content, logprobs, finish, self._usage())

    def _usage(self) -> dict[str, int] | None:
        """The usage so far, for ``continuous_usage_stats``."""
        if not self.continuous:
            return None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
        }


def _error_event(error: ApiError) -> str:
    """A stream's last event when it fails after its first."""
    return _sse(
        {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": None}}
    )


class _Failure(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


async def _guarded(
    stream: AsyncIterator[generation_pb2.GenerateResponse],
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The stream, its failures turned into the HTTP errors they answer as."""
    try:
        async with contextlib.aclosing(stream):
            async for response in stream:
                yield response
    except NoWorkerAvailable as err:
        raise _Failure(ApiError(503, str(err), "service_unavailable")) from None
    except WorkerError as err:
        status, kind = _WORKER_STATUS.get(err.code, (502, "worker_error"))
        raise _Failure(ApiError(status, str(err), kind)) from None


async def _unless_disconnected(request: Request, work: asyncio.Future[Any]) -> Any:
    """``work``'s result; cancelled (and so cancelled on the workers) if the client goes."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(_DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ApiError(499, "the client closed the request", "client_closed")
    return work.result()


_WORKER_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
"""HTTP answers to a worker's own refusal (what no other worker would make good)."""

_PARAMS = {
    "token_ids": "prompt",
    "chat": "messages",
    "chat.messages": "messages",
    "chat.tools_json": "tools",
    "chat.template_kwargs_json": "chat_template_kwargs",
    "sampling": "",
}
"""The OpenAI parameter a validator field stands for, where the names differ (by the
field's first one or two parts)."""


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _location(loc: Sequence[str | int]) -> str:
    """A pydantic error location as the parameter it names: ``("body", "prompt", 1)`` is
    ``prompt[1]``; the tags of a union's members (``str``, ``list[int]``,
    ``constrained-str``) and of a dict's keys are left out."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif (i == 0 and part == "body") or part in _TYPE_TAGS or not part.isidentifier():
            continue
        else:
            out += f".{part}" if out else part
    return out


def _param(field: str) -> str:
    """The OpenAI parameter for a validator field: ``chat.messages[2].tool_calls_json``
    is ``messages[2].tool_calls``, ``sampling.top_p`` is ``top_p``."""
    for prefix in sorted(_PARAMS, key=len, reverse=True):
        if field == prefix or field.startswith((f"{prefix}.", f"{prefix}[")):
            name = _PARAMS[prefix] + field[len(prefix) :]
            return name.lstrip(".").removesuffix("_json").replace("_json.", ".")
    return field


def _usage(usages: dict[int, generation_pb2.Usage | None], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
    firsts = [u for i, u in usages.items() if u is not None and i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    cached = sum(u.cached_prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages.values() if u is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
