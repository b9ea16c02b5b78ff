"""Greedy output of the offline engine equals HuggingFace transformers, token for token,
in float32 — plain, with chunked prefill forced small, on a prefix-cache hit, and with a
KV pool so small that requests get preempted and recomputed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.cli.make_model import ARCHS as MAKE_MODEL_ARCHS
from tandem.engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
ARCHS = list(MAKE_MODEL_ARCHS)  # every family `tandem make-model` makes


def assert_pool_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.num_kv_blocks, "KV blocks leaked"
    assert all(b.ref_count == 0 for b in engine.block_pool.blocks)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Mixed lengths, several beyond the tiny Mistral's 64-token sliding window.
    return random_prompts(10, vocab=4096, lengths=(1, 110))


@pytest.fixture(scope="module")
def reference(make_checkpoint: Callable[..., Path], prompts: list[list[int]]):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str, **kw: object) -> tuple[Path, list[list[int]]]:
        model_dir = make_checkpoint(arch, **kw)
        if str(model_dir) not in cache:
            cache[str(model_dir)] = hf_greedy(model_dir, prompts, NUM_NEW)
        return model_dir, cache[str(model_dir)]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str, reference, prompts) -> None:
    model_dir, expected = reference(arch)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    # Second pass: every prompt's leading full blocks come from the prefix cache.
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    for out, prompt in zip(again, prompts, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_pool_idle(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_with_tiny_prefill_chunks(arch: str, reference, prompts) -> None:
    model_dir, expected = reference(arch)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pool_idle(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_under_preemption(arch: str, reference, prompts) -> None:
    model_dir, expected = reference(arch)
    # 18 blocks of 8 tokens: one 140-token sequence fits, ten together do not.
    llm = LLM(model_dir, dtype="float32", block_size=8, num_kv_blocks=18, max_model_len=144)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert_pool_idle(llm)


@pytest.mark.parametrize(
    "variant",
    [
        {"rope_scaling": "llama3"},
        {"rope_scaling": "linear", "config_style": "v5"},
        {"rope_scaling": "llama3", "config_style": "v5"},
        {"kv_heads": 1},  # MQA
        {"kv_heads": 4},  # MHA
        {"rope_scaling": "yarn", "config_style": "v5"},
    ],
    ids=["llama3-rope", "linear-rope-v5", "llama3-rope-v5", "mqa", "mha", "yarn-rope-v5"],
)
def test_llama_variants_match(variant: dict, reference, prompts) -> None:
    model_dir, expected = reference("llama", **variant)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pool_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3_moe", "deepseek_v2"])
def test_reference_backend_matches(arch: str, reference, prompts) -> None:
    model_dir, expected = reference(arch)
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=256,
        attention_backend="torch",
        max_num_batched_tokens=32,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pool_idle(llm)


def _packed_backends() -> list[str]:
    from tandem.engine.layers.linear import LinearBackend, linear_backend_available

    packed = (LinearBackend.ONEDNN, LinearBackend.NATIVE)
    cpu = torch.device("cpu")
    return [b.value for b in packed if linear_backend_available(b, cpu, torch.float32)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_linear_backend_matches(arch: str, reference, prompts) -> None:
    """Tiny models default to plain torch GEMMs (``ONEDNN_MIN_HIDDEN_SIZE``); the packed
    paths, oneDNN and the native AVX2 GEMM, the defaults for bigger ones, must give the
    same tokens (Qwen2 has q/k/v biases, so the native epilogue's bias is covered)."""
    model_dir, expected = reference(arch)
    for backend in ("torch", *_packed_backends()):
        llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, linear_backend=backend)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected, backend
        assert_pool_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_cpu_whose_best_is_avx2_defaults_to_the_native_gemm(
    arch: str, reference, prompts, monkeypatch
) -> None:
    """What an AVX2-only machine runs without flags: a model of hidden size 256 packs
    onto the native GEMM (every linear, the MLP with gate and up fused; Qwen2's q/k/v
    biases in the epilogue) and still gives transformers' tokens."""
    from tandem.engine.layers.linear import NativeGatedMLP, NativeLinear
    from tandem.engine.native_build import ISA_ENV, Isa, supported_isas

    if Isa.AVX2 not in supported_isas():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(ISA_ENV, "avx2")
    model_dir, expected = reference(arch, size="small")
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    modules = list(llm.engine.runner.model.modules())
    assert sum(isinstance(m, NativeGatedMLP) for m in modules) == 6  # every layer's MLP
    assert not any(isinstance(m, torch.nn.Linear) for m in modules)
    assert sum(isinstance(m, NativeLinear) for m in modules) == 3 * 6 + 1
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pool_idle(llm)


def test_linear_backend_follows_the_model_size_and_the_cpu(monkeypatch) -> None:
    from tandem.engine.layers.linear import (
        ONEDNN_MIN_HIDDEN_SIZE,
        LinearBackend,
        onednn_supports,
        select_linear_backend,
    )
    from tandem.engine.layers.native_gemm import native_gemm_supported
    from tandem.engine.native_build import ISA_ENV, Isa, supported_isas

    cpu = torch.device("cpu")
    small = select_linear_backend(None, cpu, torch.float32, ONEDNN_MIN_HIDDEN_SIZE - 1)
    assert small is LinearBackend.TORCH
    supported = onednn_supports(cpu, torch.float32)
    for isa in supported_isas():
        monkeypatch.setenv(ISA_ENV, isa.value)
        big = select_linear_backend(None, cpu, torch.float32, ONEDNN_MIN_HIDDEN_SIZE)
        if isa is Isa.AVX2:  # oneDNN's AVX2 kernels are the slower ones
            assert big is LinearBackend.NATIVE, isa
        else:
            assert big is (LinearBackend.ONEDNN if supported else LinearBackend.TORCH), isa
    monkeypatch.delenv(ISA_ENV)
    assert select_linear_backend(LinearBackend.TORCH, cpu, torch.float32, 4096) is (
        LinearBackend.TORCH
    )
    assert select_linear_backend(None, cpu, torch.float16, 4096) is LinearBackend.TORCH
    if native_gemm_supported():
        with pytest.raises(ValueError, match="'native' needs float32"):
            select_linear_backend(LinearBackend.NATIVE, cpu, torch.bfloat16, 4096)
    monkeypatch.setenv(ISA_ENV, "portable")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA not 'portable'"):
        select_linear_backend(LinearBackend.NATIVE, cpu, torch.float32, 4096)


@pytest.mark.parametrize("backend", ["onednn", "native"])
def test_packing_replaces_each_linear_once(
    backend: str, make_checkpoint: Callable[..., Path]
) -> None:
    """Per layer: q/k/v, o_proj and the MLP (gate/up and down together); plus the LM
    head. A replaced MLP's own linears are not packed again (that once kept every
    original weight alive until packing ended: twice the weights' memory at the peak)."""
    from torch import nn

    from tandem.common.model_config import ModelConfig
    from tandem.engine.layers.linear import (
        LinearBackend,
        linear_backend_available,
        pack_linear_layers,
    )
    from tandem.engine.loader import load_model

    if not linear_backend_available(LinearBackend(backend), torch.device("cpu"), torch.float32):
        pytest.skip(f"the {backend} linear backend is unavailable here")
    model_dir = make_checkpoint("llama")
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    assert pack_linear_layers(model, LinearBackend(backend)) == 3 * config.num_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
