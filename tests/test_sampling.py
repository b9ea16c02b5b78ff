"""Sampling: filters never leak, penalties follow their formulas, seeds reproduce."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.sampler import RowGroup, Sampler, SamplingRow, apply_penalties, filtered_probs
from tests.hf_reference import random_prompts

VOCAB = 50


def _row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    return SamplingRow(params, prompt or [], output or [], generator, ())


def _sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token per row."""
    groups = [RowGroup(i) for i in range(len(rows))]
    return [tokens[0] for tokens in sampler(logits, rows, groups).token_ids]


def _draw(params: SamplingParams, logits: torch.Tensor, n: int = 400) -> set[int]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = [_row(params)] * n
    return set(_sample(sampler, logits.expand(n, -1).clone(), rows))


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def test_top_k_never_leaves_the_k_best(logits: torch.Tensor) -> None:
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = _draw(SamplingParams(temperature=1.5, top_k=5), logits)
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_nucleus(logits: torch.Tensor) -> None:
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    allowed = set(order[mass_before < 0.6].tolist())
    seen = _draw(SamplingParams(temperature=1.0, top_p=0.6), logits)
    assert seen <= allowed and len(seen) > 1


def test_min_p_drops_unlikely_tokens(logits: torch.Tensor) -> None:
    probs = logits[0].softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    seen = _draw(SamplingParams(temperature=1.0, min_p=0.2), logits)
    assert seen <= allowed and len(seen) > 1


def test_filters_combine(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05)
    rows = [_row(params)]
    probs = filtered_probs(logits.clone(), rows)[0]
    top10 = set(logits[0].topk(10).indices.tolist())
    assert set(probs.nonzero().flatten().tolist()) <= top10
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    sampler = Sampler(torch.device("cpu"), seed=1)
    n = 20000
    tokens = torch.tensor(
        _sample(sampler, logits.expand(n, -1).clone(), [_row(SamplingParams())] * n)
    )
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)


def test_penalties_follow_their_formulas() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), [_row(params, output=[0, 0, 1], prompt=[2])])[0]
    # token 0: seen, positive -> /2, then -0.5*2 (count) -0.25 (present)
    # token 1: seen, negative -> *2, then -0.5*1 -0.25; token 2: prompt only -> /2
    assert out.tolist() == pytest.approx([1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 0.5, 0.5])


def test_min_tokens_bans_stop_tokens_only_while_short() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    row = SamplingRow(SamplingParams(temperature=0), [], [], None, (1,))
    assert _sample(sampler, logits.clone(), [row]) == [2]


def test_logit_bias_moves_each_rows_own_tokens() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 10.0, 1.0, 2.0]] * 3)
    rows = [
        _row(SamplingParams(temperature=0, logit_bias={1: -100})),  # the best banned
        _row(SamplingParams(temperature=0, logit_bias={0: 100, 99: 5})),  # 99: past vocab
        _row(SamplingParams(temperature=0)),
    ]
    assert _sample(sampler, logits.clone(), rows) == [3, 0, 1]
    forced = SamplingParams(temperature=1.0, logit_bias={2: 100})
    assert _draw(forced, torch.tensor([[0.0, 10.0, 1.0, 2.0]]), n=50) == {2}


@pytest.mark.parametrize(
    ("bias", "message"),
    [({3: 101}, "values must be in"), ({-1: 1}, "keys must be token ids"),
     ({3: float("nan")}, "values must be in")],
)  # fmt: skip
def test_logit_bias_is_checked(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"logit_bias {message}"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={5: 1, 2: -3}).logit_bias == ((2, -3.0), (5, 1.0))


@pytest.fixture(scope="module")
def llm(make_checkpoint: Callable[..., Path]) -> LLM:
    return LLM(make_checkpoint("llama"), dtype="float32", num_kv_blocks=256)


def test_seeded_output_is_independent_of_batch_composition(llm: LLM) -> None:
    prompts = random_prompts(6, 4096, (5, 60), seed=7)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30)] * 2 + [
        SamplingParams(temperature=1.2, seed=99, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    batch = llm.generate([prompts[1], prompts[0], *prompts[2:5]], [others[0], seeded, *others[1:]])
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=20)
    assert llm.generate([prompts[0]], other_seed)[0].token_ids != alone


def test_stop_strings_cut_exactly(llm: LLM) -> None:
    prompt = random_prompts(1, 4096, (20, 20), seed=3)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"degenerate text {text!r}"
    cut_at = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    assert out.text == text[:cut_at] and out.finish_reason == "stop"
    assert free.token_ids[: len(out.token_ids)] == out.token_ids
    kept = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == text[: cut_at + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = random_prompts(1, 4096, (30, 30), seed=5)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_token = free.token_ids[3]
    first = free.token_ids.index(stop_token)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token])
    )[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    late = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_token], min_tokens=first + 2
    )
    out = llm.generate([prompt], late)[0]
    assert stop_token not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2


def test_logprobs_are_sorted_and_consistent_with_greedy(llm: LLM) -> None:
    prompt = random_prompts(1, 4096, (12, 12), seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        ids, values = zip(*lp.top, strict=True)
        assert len(ids) == 3 and list(values) == sorted(values, reverse=True)
        assert ids[0] == token and lp.token_logprob == pytest.approx(values[0])
        assert all(v <= 0 for v in values)


def test_logit_bias_steers_generation(llm: LLM) -> None:
    prompt = random_prompts(1, 4096, (20, 20), seed=11)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    pushed = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={77: 100})
    assert llm.generate([prompt], pushed)[0].token_ids == [77] * 8
    banned = {t: -100 for t in set(free.token_ids)}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logit_bias=banned))[0]  # fmt: skip
    assert not set(out.token_ids) & set(free.token_ids)
