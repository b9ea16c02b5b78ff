"""Greedy reference outputs from HuggingFace ``transformers`` (a test-only dependency)."""

from __future__ import annotations

import inspect
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
    """The argmax of ``transformers``' logits at every step, one prompt at a time (no
    padding), float32, with its own KV cache: what greedy decoding with EOS ignored
    (``ignore_eos``) means. Not ``generate(min_new_tokens=...)``, which masks the EOS
    logits and so picks the runner-up wherever EOS is on top."""
    model = _hf_model(str(model_dir))
    # the cache argument's name: ``cache`` in newer releases, ``past_key_values`` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, past, tokens = torch.tensor([prompt]), None, []
            for _ in range(max_new_tokens):
                out = model(input_ids=ids, use_cache=True, **{name: past})
                past = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[tokens[-1]]])
            outputs.append(tokens)
    return outputs


def offline_greedy_checked(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The offline engine's greedy tokens (EOS ignored, float32), after checking they
    equal ``transformers``': the reference a cluster test compares its streams with."""
    from tandem.engine import LLM, SamplingParams

    offline = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    tokens = [o.token_ids for o in offline.generate(prompts, params)]
    assert tokens == hf_greedy(model_dir, prompts, max_new_tokens)
    return tokens
