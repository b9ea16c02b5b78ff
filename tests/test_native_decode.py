"""The native whole-model forward (used by small draft models) against the torch path:
same logits and the same KV written, for every architecture family, GQA, q/k/v bias, a
sliding window, and several sequences of mixed chunk lengths in one call."""

from __future__ import annotations

import pytest
import torch

from tandem.common.model_config import ModelConfig
from tandem.engine.attention.base import AttentionBackendKind
from tandem.engine.attention.native import paged_decode_library
from tandem.engine.layers.linear import LinearBackend
from tandem.engine.layers.native_gemm import native_gemm_supported
from tandem.engine.model_runner import KVCacheLayout, ModelRunner
from tandem.engine.models.native_decode import NativeDecoder
from tandem.engine.scheduler import ScheduledChunk
from tandem.engine.spec_decode.draft_model import DraftSequence

pytestmark = pytest.mark.skipif(paged_decode_library() is None, reason="no C compiler")

BLOCK = 16


def _runner(
    model_dir, num_blocks: int = 64, linear: LinearBackend = LinearBackend.TORCH
) -> ModelRunner:
    config = ModelConfig.from_dir(model_dir)
    layout = KVCacheLayout(
        BLOCK, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    runner = ModelRunner(
        str(model_dir),
        config,
        layout,
        AttentionBackendKind.TORCH,
        linear,
        torch.device("cpu"),
        {1},
        0,
    )
    runner.allocate_kv_cache(num_blocks)
    return runner


def _chunk(seq: DraftSequence, start: int, end: int, blocks: tuple[int, ...]) -> ScheduledChunk:
    return ScheduledChunk(seq, start, end - start, blocks)


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 24}), ("llama", {"kv_heads": 4})],
)
def test_native_forward_matches_torch(make_checkpoint, arch: str, kwargs: dict) -> None:
    model_dir = make_checkpoint(arch, **kwargs)
    torch_runner, native_runner = _runner(model_dir), _runner(model_dir)
    native = NativeDecoder(native_runner.model, native_runner.kv_caches, BLOCK)
    gen = torch.Generator().manual_seed(0)
    seqs = [
        DraftSequence(f"r{i}", torch.randint(3, 4000, (n,), generator=gen).tolist())
        for i, n in enumerate((40, 9))
    ]
    blocks = [tuple(range(0, 4)), tuple(range(10, 14))]
    # Prompts through the torch path on both runners: the caches start identical.
    for runner in (torch_runner, native_runner):
        runner.last_logits(
            [_chunk(s, 0, s.num_tokens - 3, b) for s, b in zip(seqs, blocks, strict=True)]
        )
    # The rest: a 3-token chunk and, after it, single-token steps (a draft's catch-up, then
    # its drafts), past the sliding window for mistral.
    steps = [[(s, s.num_tokens - 3, s.num_tokens) for s in seqs]]
    for _ in range(2):
        for s in seqs:
            s.all_token_ids.append(int(torch.randint(3, 4000, (1,), generator=gen)))
        steps.append([(s, s.num_tokens - 1, s.num_tokens) for s in seqs])
    for step in steps:
        chunks = [_chunk(s, a, e, b) for (s, a, e), b in zip(step, blocks, strict=True)]
        expected = torch_runner.last_logits(chunks)
        got = native.last_logits(chunks)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert (got.argmax(-1) == expected.argmax(-1)).all()
    for a, b in zip(torch_runner.kv_caches, native_runner.kv_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_native_decoder_declines_what_it_cannot_run(make_checkpoint) -> None:
    model_dir = make_checkpoint("llama")
    assert NativeDecoder.supports(_runner(model_dir).model)
    packed = _runner(model_dir, linear=LinearBackend.ONEDNN)
    assert not NativeDecoder.supports(packed.model)  # the weights now live in oneDNN's layout
    if native_gemm_supported():
        native = _runner(model_dir, linear=LinearBackend.NATIVE)
        assert not NativeDecoder.supports(native.model)  # ... or in the native GEMM's panels
    assert not NativeDecoder.supports(_runner(model_dir).model.to(torch.bfloat16))


def test_bad_rows_are_refused_before_anything_is_written(make_checkpoint) -> None:
    runner = _runner(make_checkpoint("llama"), num_blocks=8)
    native = NativeDecoder(runner.model, runner.kv_caches, BLOCK)
    before = [c.clone() for c in runner.kv_caches]
    vocab = runner.model.config.vocab_size
    cases = [
        (_chunk(DraftSequence("a", [5, vocab]), 0, 2, (1,)), "outside the vocabulary"),
        (_chunk(DraftSequence("b", list(range(3, 3 + BLOCK + 1))), 0, BLOCK + 1, (1,)), "block"),
    ]
    for chunk, message in cases:
        with pytest.raises(RuntimeError, match=message):
            native.last_logits([chunk])
    with pytest.raises(ValueError, match="at least one token"):
        native.last_logits([_chunk(DraftSequence("c", [5, 6]), 2, 2, (1,))])
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))


def test_a_draft_asked_twice_without_progress_recomputes_the_last_token(make_checkpoint) -> None:
    """A request the target's step budget skipped is proposed for again with no new
    token: the draft recomputes its last token instead of running an empty chunk (which
    would hand it another request's logits)."""
    from types import SimpleNamespace

    from tandem.common.sampling_params import SamplingParams
    from tandem.engine.spec_decode.draft_model import DraftModelProposer

    model_dir = make_checkpoint("llama")
    proposer = DraftModelProposer(_runner(model_dir, num_blocks=0), 16, BLOCK, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    a = SimpleNamespace(request_id="a", all_token_ids=list(range(3, 23)), sampling_params=greedy)
    b = SimpleNamespace(request_id="b", all_token_ids=list(range(40, 49)), sampling_params=greedy)
    first = proposer.propose([(a, 3), (b, 3)])
    again = proposer.propose([(a, 3), (b, 3)])  # neither advanced
    assert again["a"].token_ids == first["a"].token_ids
    assert again["b"].token_ids == first["b"].token_ids
    alone = DraftModelProposer(_runner(model_dir, num_blocks=0), 16, BLOCK, seed=0)
    assert alone.propose([(b, 3)])["b"].token_ids == first["b"].token_ids
