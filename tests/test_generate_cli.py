"""``tandem generate`` against a fake router: a real grpc.aio server streaming canned
responses, on its own event loop in a background thread (the CLI blocks the main one)."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from tandem.cli.main import main
from tandem.common.client import astream_generate
from tandem.protos import common_pb2, generation_pb2, generation_pb2_grpc

CHUNKS = (("Hello", [11, 12]), (", world", [13]), ("!", [14]))
USAGE = generation_pb2.Usage(prompt_tokens=5, completion_tokens=4, cached_prompt_tokens=2)


class FakeRouter(generation_pb2_grpc.GenerationServicer):
    """Streams ``CHUNKS``; some prompts trigger a failure instead (see ``Generate``)."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.first_chunk_printed = threading.Event()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)

        async def shown() -> bool:
            return await asyncio.to_thread(self.first_chunk_printed.wait, 10)

        if request.prompt == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty")
        if request.prompt == "slow":
            await asyncio.sleep(30)
        for i, (text, ids) in enumerate(CHUNKS):
            last = i == len(CHUNKS) - 1
            yield generation_pb2.GenerateResponse(
                request_id="r1",
                text=text,
                token_ids=ids,
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else None,
                usage=USAGE if last else None,
            )
            if request.prompt == "break":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker lost")
            # Go on only once the client has shown the first chunk: a client that
            # buffered the whole stream would never see the rest.
            if request.prompt == "wait for the terminal" and i == 0 and not await shown():
                await context.abort(grpc.StatusCode.INTERNAL, "first chunk never shown")


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, FakeRouter]]:
    servicer = FakeRouter()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def generate(capsys: pytest.CaptureFixture[str], addr: str, *args: str) -> tuple[int, str, str]:
    """Run ``tandem generate --addr ADDR ARGS``: (exit code, stdout, stderr)."""
    code = main(["generate", "--addr", addr, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_streams_the_text_and_ends_with_a_usage_line(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = generate(capsys, router[0], "hi")
    assert (code, out) == (0, "Hello, world!\n")
    summary = err.splitlines()
    assert len(summary) == 1
    assert summary[0].startswith("prompt 5 tokens (2 cached) · completion 4 tokens · TTFT ")
    assert " tok/s · total " in summary[0]
    assert summary[0].endswith(" · finish length")


def test_text_is_shown_as_it_arrives(
    router: tuple[str, FakeRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, servicer = router

    class Terminal(io.StringIO):
        def flush(self) -> None:
            if self.getvalue():
                servicer.first_chunk_printed.set()

    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert main(["generate", "--addr", addr, "wait for the terminal"]) == 0
    assert terminal.getvalue() == "Hello, world!\n"


def test_only_the_flags_given_are_sent(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    addr, servicer = router
    flags = ["--max-tokens", "7", "--temperature", "0", "--top-k", "5", "--seed", "0"]
    generate(capsys, addr, "hi", *flags, "--stop", "a", "--stop", "b", "--model", "m")
    sent = servicer.requests[-1]
    assert sent.prompt == "hi" and sent.model == "m"
    sampling = sent.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.seed) == (
        7,
        0.0,
        5,
        0,
    )
    assert all(sampling.HasField(f) for f in ("max_tokens", "temperature", "top_k", "seed"))
    assert not any(sampling.HasField(f) for f in ("top_p", "logprobs", "repetition_penalty"))
    assert list(sampling.stop) == ["a", "b"] and not sampling.ignore_eos

    generate(capsys, addr, "hi")
    assert servicer.requests[-1].sampling == common_pb2.SamplingParams()


def test_chat_sends_one_user_turn(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    addr, servicer = router
    generate(capsys, addr, "How are you?", "--chat")
    chat = servicer.requests[-1].chat
    assert [(m.role, m.content) for m in chat.messages] == [("user", "How are you?")]
    assert chat.add_generation_prompt


def test_server_error_is_printed_with_its_code(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = generate(capsys, router[0], "invalid")
    assert (code, out, err) == (1, "", "error: INVALID_ARGUMENT: prompt must not be empty\n")


def test_error_mid_stream_keeps_the_text_so_far(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = generate(capsys, router[0], "break")
    assert (code, out, err) == (1, "Hello\n", "error: UNAVAILABLE: decode worker lost\n")


def test_timeout_gives_deadline_exceeded(
    router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = generate(capsys, router[0], "slow", "--timeout", "0.2")
    assert (code, out) == (1, "")
    assert err.startswith("error: DEADLINE_EXCEEDED: ")


def test_unreachable_router_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = generate(capsys, f"127.0.0.1:{port}", "hi", "--timeout", "5")
    assert (code, out) == (1, "")
    assert err.startswith("error: UNAVAILABLE: ")


def test_async_client_streams_token_id_prompts(router: tuple[str, FakeRouter]) -> None:
    addr, servicer = router

    async def collect() -> list[generation_pb2.GenerateResponse]:
        return [r async for r in astream_generate(addr, [1, 2, 3], timeout_s=10, priority=2)]

    responses = asyncio.run(collect())
    assert "".join(r.text for r in responses) == "Hello, world!"
    assert responses[-1].usage == USAGE
    sent = servicer.requests[-1]
    assert (list(sent.token_ids.ids), sent.priority) == ([1, 2, 3], 2)
