"""Live migration at the engine, without a transport: a running sequence taken off one
engine with ``migrate_out``, its KV blocks copied into a ``REMOTE`` request on another
that covers prompt and output, continues exactly as if it had never moved — greedy,
seeded sampling with penalties, a structured-output request, with speculation, with a
partial prefix hit on the target — and the source frees every block on release."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.common.sampling_params import StructuredKind, StructuredOutput
from tandem.engine import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Handover, LLMEngine
from tandem.engine.request import PrefillMode, RequestStatus
from tests.engine_util import run_to_completion
from tests.hf_reference import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.0,
    top_k=30,
    seed=3,
    max_tokens=40,
    ignore_eos=True,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    min_tokens=35,
)
STRUCTURED = SamplingParams(
    temperature=0, max_tokens=40, structured=StructuredOutput(StructuredKind.REGEX, r"[a-z ]{400}")
)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


def _engine(model_dir: Path, **config: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(str(model_dir), dtype="float32", num_kv_blocks=128, **config),
        detokenize=False,
    )


def _copy(src: LLMEngine, dst: LLMEngine, src_blocks: tuple[int, ...], first: int):
    """A ``finish_kv_pull`` fill: the source's blocks from ``first`` on, into ``dst``."""

    def fill(dst_blocks: list[int]) -> None:
        assert len(dst_blocks) == len(src_blocks) - first
        for s_cache, d_cache in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
            d_cache[:, dst_blocks] = s_cache[:, list(src_blocks[first:])]

    return fill


def _run_until(engine: LLMEngine, rid: str, n: int) -> list[int]:
    """Step until ``rid`` produced at least ``n`` tokens; returns them."""
    tokens: list[int] = []
    while len(tokens) < n:
        for delta in engine.step():
            if delta.request_id == rid:
                tokens += delta.new_token_ids
    return tokens


def _migrate(
    src: LLMEngine, dst: LLMEngine, prompt: list[int], params: SamplingParams, produced: list[int]
) -> tuple[Handover, int]:
    """Hand ``x`` from ``src`` to ``dst``; returns the handover and the blocks pulled."""
    handover = src.migrate_out("x")
    assert handover is not None and handover.num_tokens == len(prompt) + len(produced) - 1
    assert src.requests["x"].status is RequestStatus.PREFILLED
    dst.add_request(
        prompt,
        params,
        "x",
        output_token_ids=produced,
        prefill_mode=PrefillMode.REMOTE,
        num_remote_tokens=handover.num_tokens,
    )
    dst.step()  # admitted: waiting for the KV (a neighbour may compute meanwhile)
    (pull,) = dst.take_kv_pulls()
    assert pull.first_block + len(pull.block_ids) == len(handover.block_ids)
    assert dst.finish_kv_pull("x", _copy(src, dst, handover.block_ids, pull.first_block))
    return handover, len(pull.block_ids)


@pytest.mark.parametrize(
    ("params", "config"),
    [
        (GREEDY, {}),
        (SEEDED, {}),
        (STRUCTURED, {}),
        (GREEDY, {"speculative_method": "ngram"}),
    ],
    ids=["greedy", "seeded-penalties", "structured", "speculative"],
)
def test_a_migrated_sequence_continues_exactly(model_dir: Path, params, config) -> None:
    prompt, neighbour = random_prompts(2, 4096, (37, 37), seed=21)
    reference = _engine(model_dir, **config)
    reference.add_request(prompt, params, "x")
    expected = run_to_completion(reference, "x")
    assert len(expected) >= 20

    src, dst = _engine(model_dir, **config), _engine(model_dir, **config)
    src.add_request(neighbour, GREEDY, "n")  # batch company on the source
    src.add_request(prompt, params, "x")
    produced = _run_until(src, "x", 11)
    _, pulled = _migrate(src, dst, prompt, params, produced)
    assert pulled == -(-(len(prompt) + len(produced) - 1) // 16)  # nothing cached there
    assert produced + run_to_completion(dst, "x") == expected

    free_before = src.block_pool.num_free_blocks
    assert src.release_prefilled("x") and "x" not in src.requests
    assert src.block_pool.num_free_blocks > free_before
    run_to_completion(src, "n")
    for engine in (src, dst):
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        assert not engine.requests


def test_only_the_blocks_the_target_lacks_move(model_dir: Path) -> None:
    """The target already caches the prompt (an earlier request shared it): the pull
    starts after those blocks, and the output is unchanged."""
    prompt = random_prompts(1, 4096, (48, 48), seed=5)[0]
    reference = _engine(model_dir)
    reference.add_request(prompt, GREEDY, "x")
    expected = run_to_completion(reference, "x")

    src, dst = _engine(model_dir), _engine(model_dir)
    dst.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), "warm")
    run_to_completion(dst, "warm")
    src.add_request(prompt, GREEDY, "x")
    produced = _run_until(src, "x", 20)
    handover, pulled = _migrate(src, dst, prompt, GREEDY, produced)
    # 48 prompt tokens = 3 full blocks cached on the target; the rest move.
    assert pulled == len(handover.block_ids) - 3
    assert dst.requests["x"].num_cached_tokens == 48
    assert produced + run_to_completion(dst, "x") == expected


def test_a_sequence_without_kv_hands_over_no_blocks(model_dir: Path) -> None:
    """Queued (not admitted) requests have no KV: they leave with an empty handover and
    the engine forgets them; unknown and finished ids give ``None``."""
    engine = _engine(model_dir, max_num_seqs=1)
    prompts = random_prompts(2, 4096, (20, 20), seed=8)
    engine.add_request(prompts[0], GREEDY, "a")
    engine.add_request(prompts[1], GREEDY, "b")
    engine.step()
    assert engine.requests["b"].status is RequestStatus.WAITING
    assert engine.migrate_out("b") == Handover((), 0)
    assert "b" not in engine.requests
    assert engine.migrate_out("b") is None
    assert engine.migrate_out("nobody") is None
    run_to_completion(engine, "a")
    assert engine.migrate_out("a") is None
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_remote_tokens_must_leave_one_to_compute(model_dir: Path) -> None:
    engine = _engine(model_dir)
    prompt = random_prompts(1, 4096, (20, 20), seed=9)[0]
    with pytest.raises(ValueError, match="at most 21 of the request's 22 tokens"):
        engine.add_request(
            prompt,
            GREEDY,
            "x",
            output_token_ids=[1, 2],
            prefill_mode=PrefillMode.REMOTE,
            num_remote_tokens=22,
        )
    with pytest.raises(ValueError, match="pulls none"):
        engine.add_request(prompt, GREEDY, "y", num_remote_tokens=5)
