"""Half-precision checkpoints run in their own dtype and agree with transformers on the
first token; the engine reports prefix-cache events through its callback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.common.kv_events.events import BlocksEvicted, BlocksStored, KVCacheEvent
from tandem.engine import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tests.hf_reference import random_prompts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_runs_in_its_dtype(make_checkpoint, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint("llama", dtype=dtype)
    engine = LLMEngine(EngineConfig(str(model_dir), num_kv_blocks=256))  # dtype "auto"
    assert engine.runtime.dtype == getattr(torch, dtype)
    assert all(c.dtype == getattr(torch, dtype) for c in engine.runner.kv_caches)
    prompts = random_prompts(8, 4096, (5, 60), seed=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8), request_id=str(i))
    firsts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            firsts.setdefault(delta.request_id, delta.new_token_ids[0])
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        assert firsts[str(i)] == int(logits.argmax()), f"prompt {i}"
    assert engine.block_pool.num_free_blocks == engine.num_kv_blocks


def test_kv_events_reach_the_callback(make_checkpoint: Callable[..., Path]) -> None:
    events: list[KVCacheEvent] = []
    config = EngineConfig(str(make_checkpoint("llama")), num_kv_blocks=140, max_model_len=256)
    engine = LLMEngine(config, on_kv_events=events.extend)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    for i, prompt in enumerate(random_prompts(12, 4096, (250, 250), seed=i) for i in range(12)):
        engine.add_request(prompt[0], greedy, request_id=str(i))
        while engine.has_unfinished_requests():
            engine.step()
    stored = [h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes]
    evicted = [h for e in events if isinstance(e, BlocksEvicted) for h in e.block_hashes]
    assert len(stored) == 12 * 15  # 250 tokens = 15 full blocks each
    assert evicted and set(evicted) <= set(stored)  # 140 blocks cannot keep them all
    assert evicted[:15] == stored[:15][::-1]  # the oldest prompt goes first, tail first
