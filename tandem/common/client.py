"""Client helpers for Tandem's public ``Generation`` API, sync and asyncio.

``stream_generate`` / ``astream_generate`` send one request and yield its responses as
they arrive; ``AsyncGenerationClient`` keeps one channel open for many concurrent
requests (what a load generator needs). Sampling travels as the wire message
``common_pb2.SamplingParams``: fields left unset take the server's defaults, and the
server validates everything (``tandem.common.wire.sampling_to_proto`` converts tandem's
``SamplingParams``). ``StreamClock`` times a stream on the client side (TTFT, time per
output token) for the CLI and the benchmarks.

gRPC failures surface as ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError``
(asyncio), with the server's status code and details.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from tandem.protos import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


@dataclass(frozen=True)
class Chat:
    """Chat messages as ``(role, content)`` pairs, rendered by the server's template."""

    messages: tuple[tuple[str, str], ...]
    add_generation_prompt: bool = True


Prompt = str | Sequence[int] | Chat
"""A text prompt, prompt token ids, or a chat."""


def build_request(
    prompt: Prompt,
    sampling: common_pb2.SamplingParams | None = None,
    *,
    model: str = "",
    request_id: str = "",
    priority: int = 0,
) -> generation_pb2.GenerateRequest:
    """The ``GenerateRequest`` for ``prompt``; empty ``model``/``request_id``: server's choice."""
    request = generation_pb2.GenerateRequest(
        model=model, request_id=request_id, priority=priority, sampling=sampling
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, Chat):
        turns = [generation_pb2.ChatMessage(role=r, content=c) for r, c in prompt.messages]
        request.chat.messages.extend(turns)
        request.chat.add_generation_prompt = prompt.add_generation_prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def stream_generate(
    addr: str,
    prompt: Prompt,
    sampling: common_pb2.SamplingParams | None = None,
    *,
    timeout_s: float | None = None,
    model: str = "",
    request_id: str = "",
    priority: int = 0,
    api_key: str | None = None,
    root_certificates: bytes | None = None,
) -> Iterator[generation_pb2.GenerateResponse]:
    """Stream one completion from the router at ``addr`` (``host:port``), blocking.

    The channel lives as long as the iterator: closing the iterator early (or dropping
    it) cancels the request. ``timeout_s`` bounds the whole stream (gRPC deadline).
    ``api_key``: sent as ``authorization: Bearer <key>`` when the router requires keys;
    ``root_certificates``: PEM roots for a router serving TLS.
    """
    request = build_request(prompt, sampling, model=model, request_id=request_id, priority=priority)
    channel = (
        grpc.insecure_channel(addr)
        if root_certificates is None
        else grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates))
    )
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        yield from stub.Generate(request, timeout=timeout_s, metadata=auth_metadata(api_key))


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``api_key`` (none without a key)."""
    return () if api_key is None else (("authorization", f"Bearer {api_key}"),)


async def astream_generate(
    addr: str,
    prompt: Prompt,
    sampling: common_pb2.SamplingParams | None = None,
    *,
    timeout_s: float | None = None,
    model: str = "",
    request_id: str = "",
    priority: int = 0,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """``stream_generate`` for asyncio, on a channel of its own."""
    request = build_request(prompt, sampling, model=model, request_id=request_id, priority=priority)
    async with AsyncGenerationClient(addr) as client:
        async for response in client.generate(request, timeout_s=timeout_s):
            yield response


class AsyncGenerationClient:
    """One asyncio channel to a router, shared by any number of concurrent requests.

    Use it as ``async with`` or call ``aclose()``; closing cancels requests in flight.
    """

    def __init__(
        self, addr: str, api_key: str | None = None, root_certificates: bytes | None = None
    ):
        """``root_certificates``: PEM roots for a router serving TLS (``None``: plaintext)."""
        self._channel = (
            grpc.aio.insecure_channel(addr)
            if root_certificates is None
            else grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates))
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = auth_metadata(api_key)

    def generate(
        self, request: generation_pb2.GenerateRequest, *, timeout_s: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The call for one request: ``async for`` yields its ``GenerateResponse``s as they
        arrive (no extra task per request), ``cancel()`` stops it."""
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    async def list_models(
        self, *, timeout_s: float | None = None
    ) -> generation_pb2.ListModelsResponse:
        return await self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=timeout_s, metadata=self._metadata
        )

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@dataclass(frozen=True)
class StreamTiming:
    """When one stream's events happened, in seconds of one monotonic clock.

    ``first_token_at`` and ``last_token_at`` are both ``None`` when no token arrived.
    Tokens that arrive in one message share its timestamp.
    """

    sent_at: float
    first_token_at: float | None
    last_token_at: float | None
    finished_at: float
    num_tokens: int

    @property
    def ttft_s(self) -> float | None:
        """Time to first token; ``None`` when no token arrived."""
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); ``None`` if n < 2."""
        if self.first_token_at is None or self.last_token_at is None or self.num_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.num_tokens - 1)

    @property
    def e2e_s(self) -> float:
        """From sending the request to the end of the stream."""
        return self.finished_at - self.sent_at


class StreamClock:
    """Times one stream: built when the request is sent, ``observe`` each response, ``finish``.

    Costs one clock read per response that carries tokens.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._sent_at = clock()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_tokens = 0

    def observe(self, response: generation_pb2.GenerateResponse) -> None:
        num_tokens = len(response.token_ids)
        if num_tokens == 0:
            return
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now
        self._num_tokens += num_tokens

    def finish(self) -> StreamTiming:
        return StreamTiming(
            sent_at=self._sent_at,
            first_token_at=self._first_token_at,
            last_token_at=self._last_token_at,
            finished_at=self._clock(),
            num_tokens=self._num_tokens,
        )


def worker_status(
    channel: grpc.Channel, role: str, timeout_s: float = 10.0
) -> worker_pb2.WorkerStatus:
    """A worker's ``GetStatus`` over a blocking channel; ``role``: ``prefill`` or ``decode``."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    stub = (
        worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    )
    return stub(channel).GetStatus(worker_pb2.StatusRequest(), timeout=timeout_s)
