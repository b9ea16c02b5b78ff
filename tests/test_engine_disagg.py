"""The engine's half of disaggregated serving, without any transport: a HAND_OFF request
on one engine, its KV copied into a REMOTE request on another, gives exactly the output
of one engine doing both — also for seeded sampling, on fallback, and with a partial
local prefix hit on the decode side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import PrefillMode
from tests.engine_util import run_to_completion
from tests.hf_reference import random_prompts


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(str(model_dir), dtype="float32", num_kv_blocks=128), detokenize=False
    )


def _prefill(p: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> int:
    p.add_request(prompt, params, request_id=rid, prefill_mode=PrefillMode.HAND_OFF)
    deltas = [d for _ in range(20) for d in p.step() if d.request_id == rid]
    assert len(deltas) == 1 and deltas[0].prefilled and deltas[0].finish_reason is None
    assert not p.has_unfinished_requests()
    return deltas[0].new_token_ids[0]


def _copy_kv(src: LLMEngine, dst: LLMEngine, src_blocks: list[int]) -> Callable[[list[int]], None]:
    def fill(dst_blocks: list[int]) -> None:
        first = len(src_blocks) - len(dst_blocks)
        for s_cache, d_cache in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
            d_cache[:, dst_blocks] = s_cache[:, src_blocks[first:]]

    return fill


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("pull_ok", [True, False], ids=["pulled", "fallback"])
def test_hand_off_then_remote_decode_equals_local(model_dir: Path, params, pull_ok: bool) -> None:
    prompt = random_prompts(1, 4096, (45, 45), seed=11)[0]
    local = _engine(model_dir)
    local.add_request(prompt, params, request_id="x")
    expected = run_to_completion(local, "x")

    p, d = _engine(model_dir), _engine(model_dir)
    first = _prefill(p, prompt, params, "x")
    assert first == expected[0]
    src_blocks = p.prefilled_block_ids("x")
    assert len(src_blocks) == 3  # 45 tokens in 16-token blocks

    d.add_request(
        prompt, params, request_id="x", output_token_ids=[first], prefill_mode=PrefillMode.REMOTE
    )
    assert d.step() == []  # admitted: waiting for its KV, nothing to compute yet
    (pull,) = d.take_kv_pulls()
    assert pull.first_block == 0 and len(pull.block_ids) == 3
    assert d.finish_kv_pull("x", _copy_kv(p, d, src_blocks) if pull_ok else None)
    assert [first, *run_to_completion(d, "x")] == expected

    assert p.release_prefilled("x") and not p.release_prefilled("x")
    for engine in (p, d):
        assert engine.block_pool.num_free_blocks == engine.num_kv_blocks


def test_decode_side_pulls_only_blocks_it_lacks(model_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = random_prompts(1, 4096, (32, 32), seed=3)[0]
    prompt = shared + random_prompts(1, 4096, (20, 20), seed=4)[0]
    p, d = _engine(model_dir), _engine(model_dir)
    d.add_request([*shared, 99], greedy, request_id="warm")  # leaves 2 cached blocks on d
    run_to_completion(d, "warm")
    first = _prefill(p, prompt, greedy, "x")
    d.add_request(
        prompt, greedy, request_id="x", output_token_ids=[first], prefill_mode=PrefillMode.REMOTE
    )
    d.step()
    (pull,) = d.take_kv_pulls()
    assert pull.first_block == 2 and len(pull.block_ids) == 2  # 52 tokens = 4 blocks
    d.finish_kv_pull("x", _copy_kv(p, d, p.prefilled_block_ids("x")))
    local = _engine(model_dir)
    local.add_request(prompt, greedy, request_id="x")
    assert [first, *run_to_completion(d, "x")] == run_to_completion(local, "x")


def test_abort_while_waiting_for_kv_frees_blocks_and_skips_fill(model_dir: Path) -> None:
    d = _engine(model_dir)
    d.add_request(
        [11] * 40,
        SamplingParams(max_tokens=5),
        request_id="x",
        output_token_ids=[12],
        prefill_mode=PrefillMode.REMOTE,
    )
    d.step()
    assert len(d.take_kv_pulls()) == 1
    assert d.abort_request("x")
    called = []
    assert not d.finish_kv_pull("x", called.append)
    assert called == [] and d.block_pool.num_free_blocks == d.num_kv_blocks


def test_first_token_that_finishes_is_not_handed_off(model_dir: Path) -> None:
    p = _engine(model_dir)
    p.add_request(
        [11] * 20, SamplingParams(max_tokens=1), request_id="x", prefill_mode=PrefillMode.HAND_OFF
    )
    (delta,) = p.step()
    assert delta.finish_reason == "length" and not delta.prefilled
    assert p.prefilled_block_ids("x") is None
    assert p.block_pool.num_free_blocks == p.num_kv_blocks


def test_remote_request_needs_the_first_token(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="first token"):
        _engine(model_dir).add_request([11, 12], prefill_mode=PrefillMode.REMOTE)
