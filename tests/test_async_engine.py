"""The asyncio front of the engine (``AsyncEngine``): a request left early is aborted,
and its id is not reused until the abort has run, so a new stream never receives the
old request's tokens."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine import SamplingParams
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tests.hf_reference import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


async def _tokens(engine: AsyncEngine, prompt: list[int], request_id: str) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.generate(prompt, GREEDY, request_id):
        tokens += delta.new_token_ids
    return tokens


def test_an_id_left_early_is_refused_until_its_abort_ran_then_serves_cleanly(
    make_checkpoint: Callable[..., Path],
) -> None:
    config = EngineConfig(model=str(make_checkpoint("llama")), dtype="float32", num_kv_blocks=160)
    prompt = random_prompts(1, 4096, (20, 30), seed=3)[0]

    async def scenario() -> tuple[list[int], list[int]]:
        engine = AsyncEngine(LLMEngine(config))
        engine.start()
        gate = threading.Event()
        try:
            reference = await _tokens(engine, prompt, "ref")
            stream = engine.generate(prompt, GREEDY, "x")
            async for _ in stream:
                break  # leave after the first delta: the request is aborted in the background
            # Commands run in order on the engine thread: one that waits on the gate, put
            # in before the stream is closed, holds the abort back until the gate opens.
            held = asyncio.ensure_future(engine.call(lambda e: gate.wait(30)))
            await asyncio.sleep(0)  # the held command is queued
            await stream.aclose()
            with pytest.raises(ValueError, match="already in use"):  # the abort has not run
                await asyncio.wait_for(_tokens(engine, prompt, "x"), 10)
            gate.set()
            await held
            await engine.call(lambda e: None)  # queued after the abort, answered after it
            again = await _tokens(engine, prompt, "x")
            return reference, again
        finally:
            gate.set()
            await engine.stop()

    reference, again = asyncio.run(scenario())
    assert again == reference  # none of the aborted request's tokens leaked into it


def test_two_live_streams_cannot_share_an_id(make_checkpoint: Callable[..., Path]) -> None:
    config = EngineConfig(model=str(make_checkpoint("llama")), dtype="float32", num_kv_blocks=160)
    prompt = random_prompts(1, 4096, (20, 30), seed=4)[0]

    async def scenario() -> None:
        engine = AsyncEngine(LLMEngine(config))
        engine.start()
        try:
            first = asyncio.ensure_future(_tokens(engine, prompt, "same"))
            await asyncio.sleep(0)  # the first one registers its stream
            with pytest.raises(ValueError, match="already in use"):
                await _tokens(engine, prompt, "same")
            assert len(await first) == GREEDY.max_tokens
        finally:
            await engine.stop()

    asyncio.run(scenario())
