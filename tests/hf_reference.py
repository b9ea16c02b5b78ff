"""Greedy reference outputs from HuggingFace ``transformers`` (a test-only dependency)."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import torch


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Random token-id prompts; ids 0-9 are left out (special tokens live there)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``generate`` one prompt at a time (no padding), EOS ignored, float32."""
    model = _hf_model(str(model_dir))
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
