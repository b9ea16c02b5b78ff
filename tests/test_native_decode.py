"""The native whole-model forward (used by small draft models) against the torch path:
same logits and the same KV written, for every architecture family, GQA, q/k/v bias, a
sliding window, and several sequences of mixed chunk lengths in one call."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionBackendKind
from engine.attention.native import paged_decode_library
from engine.layers.linear import LinearBackend
from engine.model_runner import KVCacheLayout, ModelRunner
from engine.models.native_decode import NativeDecoder
from engine.scheduler import ScheduledChunk
from engine.spec_decode.draft_model import DraftSequence
from tandem.model_config import ModelConfig

pytestmark = pytest.mark.skipif(paged_decode_library() is None, reason="no C compiler")

BLOCK = 16


def _runner(model_dir, num_blocks: int = 64) -> ModelRunner:
    config = ModelConfig.from_dir(model_dir)
    layout = KVCacheLayout(
        BLOCK, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    runner = ModelRunner(
        str(model_dir),
        config,
        layout,
        AttentionBackendKind.TORCH,
        LinearBackend.TORCH,
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
    config = ModelConfig.from_dir(model_dir)
    layout = KVCacheLayout(
        BLOCK, config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    packed = ModelRunner(
        str(model_dir),
        config,
        layout,
        AttentionBackendKind.TORCH,
        LinearBackend.ONEDNN,
        torch.device("cpu"),
        {1},
        0,
    )
    assert not NativeDecoder.supports(packed.model)  # the weights now live in oneDNN's layout
    assert not NativeDecoder.supports(_runner(model_dir).model.to(torch.bfloat16))
