"""Multi-turn reuse through a real cluster: the KV of a conversation's answers lives on
the decode worker that generated it (its KV events put it in the router's index), so
the next turn is prefilled there, only its new tokens computed (conditional
disaggregation), instead of a prefill worker recomputing the answers. Usage reports the
tokens served from cache; the output equals the offline engine's either way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.metrics import Scrape
from tandem.engine import LLM, SamplingParams
from tandem.protos import common_pb2
from tests.cluster_util import cluster_factory
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TURNS, ANSWER, USER = 3, 40, (24, 40)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture
def make_cluster(
    model_dir: Path, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., LocalCluster]]:
    with cluster_factory(model_dir, redis_url, tmp_path / "logs", "turns") as make:

        def start(router_args: tuple[str, ...] = ()) -> LocalCluster:
            return make(
                num_decode=2,
                worker_args=("--num-kv-blocks", "256"),
                router_args=router_args,
                metrics_port=0,
            )

        yield start


async def _conversation(
    cluster: LocalCluster, turns: list[list[int]]
) -> tuple[list[list[int]], list[common_pb2.Usage]]:
    """Each turn's prompt is the history (user turns and answers) plus the new turn."""
    history: list[int] = []
    answers, usages = [], []
    greedy = common_pb2.SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    async with AsyncGenerationClient(cluster.router_address) as client:
        for user in turns:
            prompt = history + user
            answer: list[int] = []
            async for response in client.generate(build_request(prompt, greedy), timeout_s=60):
                answer += response.token_ids
                if response.HasField("usage"):
                    usages.append(response.usage)
            answers.append(answer)
            history = prompt + answer
            await asyncio.sleep(0.5)  # the user reads; the answer's KV events reach the router
    return answers, usages


def _expected(model_dir: Path, turns: list[list[int]]) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    history: list[int] = []
    answers = []
    for user in turns:
        (out,) = llm.generate([history + user], greedy)
        answers.append(out.token_ids)
        history = history + user + out.token_ids
    return answers


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "always-remote"])
def test_later_turns_reuse_the_answers_kv_on_the_decode_worker(
    make_cluster, model_dir, conditional
) -> None:
    cluster = make_cluster(() if conditional else ("--max-local-prefill-tokens", "0"))
    turns = random_prompts(TURNS, 4096, USER, seed=71)
    answers, usages = asyncio.run(_conversation(cluster, turns))
    assert answers == _expected(model_dir, turns)
    metrics = Scrape.of(f"http://127.0.0.1:{cluster.metrics_ports['router']}/metrics")
    local = metrics.value("router_local_prefills_total", reason="cached_on_decode")
    history = 0
    for turn, (user, usage) in enumerate(zip(turns, usages, strict=True)):
        earlier = history  # the tokens of earlier turns, answers included, in this prompt
        if turn and conditional:
            # Every full block of the history was on the decode worker that answered
            # (all of it but the answer's last token, which it sampled and never fed).
            assert usage.cached_prompt_tokens == (earlier - 1) // 16 * 16, (turn, usage)
        elif turn:
            # The prefill worker holds the last prompt, not the answer that followed it.
            previous_prompt = earlier - ANSWER
            assert usage.cached_prompt_tokens == previous_prompt // 16 * 16, (turn, usage)
        history += len(user) + ANSWER
    assert local == (TURNS - 1 if conditional else 0)


def test_a_first_turn_still_goes_to_the_prefill_pool(make_cluster) -> None:
    """Conditional disaggregation changes nothing for a prompt no decode worker holds
    more of than the prefill pool: the same prompt twice is prefilled remotely twice."""
    cluster = make_cluster()
    prompt = random_prompts(1, 4096, (80, 80), seed=72)[0]
    greedy = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def twice() -> None:
        async with AsyncGenerationClient(cluster.router_address) as client:
            for _ in range(2):
                async for _response in client.generate(build_request(prompt, greedy)):
                    pass
                await asyncio.sleep(0.5)

    asyncio.run(twice())
    time.sleep(0.2)
    metrics = Scrape.of(f"http://127.0.0.1:{cluster.metrics_ports['router']}/metrics")
    assert metrics.value("router_prefill_requests_total") == 2
    assert metrics.value("router_local_prefills_total") == 0
