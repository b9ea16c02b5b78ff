"""The checkpoint maker: transformers loads what it writes, deterministically."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.tools.checkpoint_maker import PRESETS, make_model

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2", "mistral")
ROPE_THETA = {"llama": 500_000.0, "qwen2": 1_000_000.0, "mistral": 10_000.0}
PROMPTS = ("def fibonacci(n):", "Hello, world! This is", "import os\nclass", "你好 🎉")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``made(arch, **make_model_kwargs)``: a tiny checkpoint, written once per module."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs: object) -> Path:
        key = (arch, *sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_model(tmp_path_factory.mktemp(arch), arch=arch, **kwargs)
        return cache[key]

    return make


def _load(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, "missing/unexpected/mismatched weights"
    return model.eval()


@pytest.mark.parametrize("rope_scaling", ["none", "linear", "llama3"])
@pytest.mark.parametrize("config_style", ["legacy", "v5"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_variant(
    made: Callable[..., Path], arch: str, config_style: str, rope_scaling: str
) -> None:
    d = made(arch, config_style=config_style, rope_scaling=rope_scaling)
    raw = json.loads((d / "config.json").read_text())
    assert ("rope_parameters" in raw) == (config_style == "v5")
    assert ("rope_scaling" in raw) == (config_style == "legacy")
    model = _load(d)
    config = model.config
    assert type(model).__name__ == raw["architectures"][0]
    assert (config.hidden_size, config.num_hidden_layers) == (64, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.intermediate_size, config.vocab_size) == (192, 4096)
    assert config.max_position_embeddings == 2048
    rope = config.rope_parameters
    assert rope["rope_theta"] == ROPE_THETA[arch]
    assert rope["rope_type"] == {"none": "default"}.get(rope_scaling, rope_scaling)
    if rope_scaling == "llama3":
        assert rope["original_max_position_embeddings"] == 1024 < config.max_position_embeddings
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert getattr(config, "sliding_window", None) == (64 if arch == "mistral" else None)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    _assert_weights_equal_file(model, d)


def _assert_weights_equal_file(model: torch.nn.Module, model_dir: Path) -> None:
    stored = load_file(model_dir / "model.safetensors")
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor), name
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in stored
        assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"])


def test_hf_tokenizer_agrees_with_ours(made: Callable[..., Path]) -> None:
    from tandem.common.tokenizer import Tokenizer

    d = made("qwen2")
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for text in PROMPTS:
        assert ours.encode(text) == hf(text).input_ids
    assert ours.eos_token_ids == frozenset(
        json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    )


def test_same_seed_same_bytes_other_seed_other_weights(
    made: Callable[..., Path], tmp_path: Path
) -> None:
    first = made("llama", seed=3)
    again = make_model(tmp_path / "again", arch="llama", seed=3)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    other = load_file(made("llama", seed=4) / "model.safetensors")
    for name, tensor in load_file(first / "model.safetensors").items():
        assert not torch.equal(tensor, other[name]), name


def test_bfloat16_checkpoint_stores_bfloat16(made: Callable[..., Path]) -> None:
    d = made("mistral", dtype="bfloat16", config_style="v5")
    stored = load_file(d / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    full = load_file(made("mistral", config_style="v5") / "model.safetensors")
    assert all(torch.equal(stored[k], full[k].to(torch.bfloat16)) for k in full)
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    assert _load(d).dtype == torch.bfloat16


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_kv_heads_override_builds_mqa_and_mha(made: Callable[..., Path], kv_heads: int) -> None:
    model = _load(made("llama", kv_heads=kv_heads))
    assert model.config.num_key_value_heads == kv_heads
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (kv_heads * 16, 64)


def test_sliding_window_and_vocab_overrides(made: Callable[..., Path]) -> None:
    model = _load(made("mistral", sliding_window=8, vocab_size=1024))
    assert model.config.sliding_window == 8
    assert model.config.vocab_size == 1024 == model.lm_head.weight.shape[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_heads": 3},
        {"arch": "llama", "sliding_window": 8},
        {"size": "huge"},
        {"dtype": "int8"},
        {"rope_scaling": "longrope"},
        {"vocab_size": 100},
    ],
)
def test_invalid_requests_raise_value_error(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path / "m", **kwargs)


def test_medium_preset_has_the_benchmark_shape() -> None:
    preset = PRESETS["medium"]
    assert (preset.hidden_size, preset.num_layers, preset.num_heads) == (768, 12, 12)
    assert (preset.num_kv_heads, preset.intermediate_size) == (4, 3072)
    params = _count_params(transformers.AutoConfig.for_model("llama", **_medium_fields()))
    assert 105e6 < params < 115e6


@pytest.mark.parametrize(
    "arch, size",
    [("qwen2", "small"), ("llama", "medium")],
)
def test_larger_presets_load(made: Callable[..., Path], arch: str, size: str) -> None:
    d = made(arch, size=size)
    model = _load(d)
    preset = PRESETS[size]
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (
        preset.hidden_size,
        preset.num_layers,
    )
    _assert_weights_equal_file(model, d)


def _medium_fields() -> dict[str, int]:
    p = PRESETS["medium"]
    return {
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "intermediate_size": p.intermediate_size,
        "vocab_size": 4096,
    }


def _count_params(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_cli_writes_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = ["make-model", str(out), "--arch", "qwen2", "--config-style", "v5", "--seed", "7"]
    subprocess.run([sys.executable, "-m", "tandem.cli", *cmd], check=True, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["rope_parameters"]["rope_theta"] == 1_000_000.0


def test_cli_reports_an_invalid_request(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tandem.cli.main import main

    assert main(["make-model", str(tmp_path / "m"), "--kv-heads", "3"]) == 2
    assert "kv_heads must divide num_heads=4" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_are_well_separated_and_do_not_collapse(
    made: Callable[..., Path], arch: str
) -> None:
    d = made(arch)
    model = _load(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    margins = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 8, f"greedy output collapsed: {new}"
        margins += [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    assert statistics.median(margins) > 0.3
    assert sum(m < 1e-3 for m in margins) <= 1
