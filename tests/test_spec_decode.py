"""Speculative decoding: lossless (greedy output unchanged with every proposer, sampled
output distributed as the target's), rolled back cleanly, adaptive."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tandem.engine.spec_decode.rejection as rejection
from tandem.common.sampling_params import SpecMethod, SpeculativeOptions
from tandem.engine import LLM, SamplingParams
from tandem.engine.spec_decode.adaptive import AdaptiveK, best_k
from tandem.engine.spec_decode.ngram import lookup
from tests.hf_reference import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def draft(make_checkpoint: Callable[..., Path]) -> Path:
    """A different random model of the same vocabulary: it disagrees with the target a lot."""
    return make_checkpoint("llama", seed=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    plain = random_prompts(6, 4096, (10, 80), seed=1)
    return plain + [p[:12] * 4 for p in plain[:3]]  # some that repeat themselves


@pytest.fixture(scope="module")
def reference(target: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(target, dtype="float32", num_kv_blocks=512)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.num_kv_blocks
    for proposer in engine.speculator.proposers.values():
        kv = getattr(proposer, "kv", None)
        if kv is not None:  # the draft's own pool: everything reclaimable once forgotten
            assert not proposer._seqs
            assert kv.pool.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize(
    "config",
    [
        {"speculative_method": "ngram"},
        {"speculative_method": "ngram", "speculative_adaptive": False},
        {"speculative_method": "draft", "draft_model": "same"},
        {"speculative_method": "draft", "draft_model": "other", "speculative_adaptive": False},
    ],
    ids=["ngram", "ngram-fixed-k", "draft-is-target", "other-draft-fixed-k"],
)
def test_greedy_output_is_unchanged(config, target, draft, prompts, reference) -> None:
    config = dict(config)
    if "draft_model" in config:
        config["draft_model"] = str(target if config["draft_model"] == "same" else draft)
    llm = LLM(target, dtype="float32", num_kv_blocks=512, **config)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_verifications > 0
    _assert_clean(llm)


def test_draft_equal_to_target_accepts_everything(target, prompts, reference) -> None:
    # A draft as big as the target is never worth it by the adaptive rule: fix k = 4.
    llm = LLM(
        target,
        dtype="float32",
        num_kv_blocks=512,
        draft_model=str(target),
        num_speculative_tokens=4,
        speculative_adaptive=False,
    )
    outs = llm.generate(prompts, GREEDY)
    stats = llm.engine.speculator.stats
    assert stats.acceptance_rate == 1.0
    assert stats.tokens_per_verification > 4.5  # k = 4 accepted + the bonus token
    assert [o.token_ids for o in outs] == reference
    # 40 tokens in steps of 5 (after the prefill step): far fewer target passes.
    assert llm.engine.num_steps < 15
    # The drafts came from the native forward (prompt catch-ups from the torch one).
    from tandem.common.sampling_params import SpecMethod
    from tandem.engine.attention.native import paged_decode_library

    proposer = llm.engine.speculator.proposers[SpecMethod.DRAFT]
    assert (proposer.native is not None) == (paged_decode_library() is not None)


def test_greedy_unchanged_under_preemption(target, draft, prompts, reference) -> None:
    llm = LLM(
        target,
        dtype="float32",
        block_size=8,
        num_kv_blocks=24,
        max_model_len=180,
        draft_model=str(draft),
        speculative_adaptive=False,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm)


def test_requests_that_finish_inside_an_accepted_run(target, prompts, reference) -> None:
    llm = LLM(
        target,
        dtype="float32",
        num_kv_blocks=512,
        draft_model=str(target),
        speculative_adaptive=False,
    )
    prompt, full = prompts[0], reference[0]
    # max_tokens that is not a multiple of k + 1, a stop token and a stop string inside a run
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert short[0].token_ids == full[:7] and short[0].finish_reason == "length"
    stop_token = full[9]
    cut = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
    )
    assert cut[0].token_ids == full[: full.index(stop_token) + 1]
    plain = LLM(target, dtype="float32", num_kv_blocks=512)
    text = plain.generate([prompt], GREEDY)[0].text
    stop = text[len(text) // 2 :][:3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    assert llm.generate([prompt], params)[0].text == plain.generate([prompt], params)[0].text
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    _assert_clean(llm)


def test_speculating_and_plain_requests_share_a_batch(target, prompts, reference) -> None:
    llm = LLM(
        target,
        dtype="float32",
        num_kv_blocks=512,
        draft_model=str(target),
        speculative_adaptive=False,
    )
    off = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, speculative=SpeculativeOptions(enabled=False)
    )
    ngram = SamplingParams(
        temperature=0,
        max_tokens=40,
        ignore_eos=True,
        speculative=SpeculativeOptions(method=SpecMethod.NGRAM, num_tokens=2),
    )
    params = [GREEDY, off, ngram] * 3
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    _assert_clean(llm)


def test_seeded_sampling_with_speculation_is_reproducible(target, draft, prompts) -> None:
    llm = LLM(target, dtype="float32", num_kv_blocks=512, draft_model=str(draft))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded)[0].token_ids
    mixed = llm.generate(
        [prompts[2], prompts[1], prompts[3]],
        [SamplingParams(temperature=1.0, max_tokens=30), seeded, GREEDY],
    )
    assert mixed[1].token_ids == alone
    _assert_clean(llm)


def _step_until_drafted(engine) -> dict[str, tuple[int, ...]]:
    """Step until some request has drafts for the next step; returns their token ids."""
    for _ in range(30):
        engine.step()
        if engine._next_drafts.proposals:
            return engine._next_drafts.token_ids
    raise AssertionError("nothing was ever proposed")


def test_drafts_go_from_one_step_to_the_next_and_leave_with_an_abort(
    target, prompts, monkeypatch
) -> None:
    """The drafts proposed at the end of a step are what the next step schedules (as the
    argument of ``Scheduler.schedule``); a request aborted in between takes its drafts
    with it, so a later request of the same id cannot inherit them."""
    llm = LLM(
        target,
        dtype="float32",
        num_kv_blocks=128,
        speculative_method="ngram",
        speculative_adaptive=False,
    )
    engine = llm.engine
    for rid, prompt in zip("xy", prompts[6:8], strict=True):  # prompts that repeat themselves
        engine.add_request(prompt, GREEDY, request_id=rid)
    proposed = _step_until_drafted(engine)
    plans = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(
        engine.scheduler, "schedule", lambda drafts: plans.append(schedule(drafts)) or plans[-1]
    )
    engine.step()
    verified = {c.request.request_id: c.draft_token_ids for c in plans[0].chunks}
    assert len(verified) == 2
    assert {rid: d for rid, d in verified.items() if d} == proposed  # the other gets none
    gone, *kept = sorted(_step_until_drafted(engine))
    assert engine.abort_request(gone)
    assert sorted(engine._next_drafts.proposals) == kept


# --- rejection sampling keeps the target distribution ---------------------------------

VOCAB = 6
P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])  # target
Q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])  # draft: very different
CHI2_CRITICAL = 20.52  # df = 5, p = 0.001


def _first_tokens(n: int, with_q: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([P, P])
    counts = torch.zeros(VOCAB)
    for _ in range(n):
        if with_q:
            draft = int(torch.multinomial(Q, 1, generator=gen))
            q = Q.unsqueeze(0)
        else:  # a deterministic proposer always guesses token 3
            draft, q = 3, None
        counts[rejection.verify_sampled(p, (draft,), q, gen)[0]] += 1
    return counts


def _chi2(counts: torch.Tensor) -> float:
    expected = P * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-model", "point-mass"])
def test_rejection_sampling_follows_the_target_distribution(with_q: bool) -> None:
    assert _chi2(_first_tokens(20000, with_q)) < CHI2_CRITICAL


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-model", "point-mass"])
def test_the_chi_square_test_catches_a_missing_residual(monkeypatch, with_q: bool) -> None:
    # Resampling from p itself instead of the residual biases towards the draft: the same
    # test must reject it, or it proves nothing.
    monkeypatch.setattr(rejection, "residual", lambda p, q, draft: p)
    assert _chi2(_first_tokens(20000, with_q)) > CHI2_CRITICAL


# --- proposers and the adaptive k ----------------------------------------------------


def test_ngram_lookup_continues_the_latest_longest_match() -> None:
    import numpy as np

    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    assert lookup(tokens, 3, 1, 3) == [2, 3, 6]  # "6 7" last seen before "2 3 6"
    assert lookup(np.array([1, 2, 3]), 3, 1, 3) == []


def test_ngram_lookup_extends_a_loop_by_its_period() -> None:
    import numpy as np

    # "1 2" last seen 3 tokens back: what followed is "9 1 2", a period of 3, repeated.
    tokens = np.array([4, 1, 2, 9, 1, 2])
    assert lookup(tokens, 7, 1, 2) == [9, 1, 2, 9, 1, 2, 9]
    assert lookup(np.array([3, 3, 3]), 4, 1, 2) == [3, 3, 3, 3]
    assert lookup(tokens, 2, 1, 2) == [9, 1]


def test_adaptive_k_backs_off_and_probes_again() -> None:
    assert best_k(0.0, 4, 0.2) == 0
    assert best_k(0.95, 4, 0.05) == 4
    controller = AdaptiveK(k_max=4)
    for _ in range(30):
        controller.observe(proposed=4, accepted=0)
    ks = [controller.next_k(0.3) for _ in range(32)]
    assert set(ks) == {0, 1} and ks.count(1) == 2  # a probe every 16 steps
    # Probes that fail space out: 16, 32, 64, ... steps apart; one that succeeds resets it.
    gaps, since = [], 0
    for _ in range(16 + 32 + 64 + 128):
        since += 1
        if controller.next_k(0.3):
            controller.observe(proposed=1, accepted=0)
            gaps.append(since)
            since = 0
    assert gaps == [16, 32, 64, 128]
    while not controller.next_k(0.3):
        pass
    controller.observe(proposed=1, accepted=1)
    assert controller.probe_every == 16


def test_adaptive_k_estimates_the_per_draft_acceptance() -> None:
    # Accepting 2 of 4 drafts, then a rejection, every time: each tested draft passes with
    # probability 2/3 (the two after the rejection were never tested).
    controller = AdaptiveK(k_max=4)
    for _ in range(40):
        controller.observe(proposed=4, accepted=2)
    assert controller.acceptance == pytest.approx(2 / 3, abs=1e-3)
    for _ in range(40):
        controller.observe(proposed=4, accepted=4)
    assert controller.acceptance > 0.99


def test_a_draft_that_cannot_follow_the_target_is_refused(target, draft, tmp_path) -> None:
    import json
    import shutil

    for field, value, message in (
        ("vocab_size", 1024, "share the target's tokenizer"),
        ("max_position_embeddings", 256, "below max_model_len"),
    ):
        bad = tmp_path / field
        shutil.copytree(draft, bad)
        config = json.loads((bad / "config.json").read_text())
        config[field] = value
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(target, dtype="float32", num_kv_blocks=256, draft_model=str(bad))


def test_a_draft_beside_a_quantized_cache_keeps_the_float_cache_memory(
    target, draft, prompts
) -> None:
    """The float draft cache gets the blocks a float target cache would have had in the
    same memory, not the quantized cache's ~4x (that would be ~4x its bytes); with a pool
    that small that it runs out, the draft proposes less and the tokens stay the same."""
    memory = {"kv_cache_memory_gb": 0.01, "max_model_len": 256}
    pools = {}
    for kind in ("auto", "int8"):
        with LLM(
            target, dtype="float32", kv_cache_dtype=kind, **memory, draft_model=str(draft)
        ) as llm:
            proposer = llm.engine.speculator.proposers[SpecMethod.DRAFT]
            pools[kind] = (llm.engine.num_kv_blocks, proposer.kv.pool.num_blocks)
            draft_bytes = sum(c.numel() * c.element_size() for c in proposer.runner.kv_caches)
            pools[kind] += (draft_bytes,)
    assert pools["auto"][1] == pools["auto"][0]  # a float target: the same blocks
    assert pools["int8"][0] > 3 * pools["auto"][0]
    assert abs(pools["int8"][1] - pools["auto"][0]) <= 1  # floors of the same memory
    block_bytes = pools["auto"][2] // pools["auto"][1]
    assert abs(pools["int8"][2] - pools["auto"][2]) <= block_bytes

    quantized = {"dtype": "float32", "kv_cache_dtype": "int8", "max_model_len": 256}
    reference = LLM(target, num_kv_blocks=512, **quantized)
    expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    # 64 target blocks, ~1/3 of them for the draft: it runs out and skips requests.
    llm = LLM(target, num_kv_blocks=64, draft_model=str(draft), **quantized)
    dim = llm.engine.runner.layout.head_dim
    draft_blocks = llm.engine.speculator.proposers[SpecMethod.DRAFT].kv.pool.num_blocks
    assert draft_blocks == max(64 * (dim + 4) // (4 * dim), 256 // 16)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.speculator.stats.num_verifications > 0
    _assert_clean(llm)
