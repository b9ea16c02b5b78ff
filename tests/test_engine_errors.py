"""Bad input gets a ValueError naming the field; failures leave nothing behind."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tandem.common.sampling_params import SamplingParams as SP
from tandem.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint: Callable[..., Path]) -> LLM:
    return LLM(make_checkpoint("llama"), dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 100}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SP(**kwargs)


def test_bad_prompts_are_refused_and_nothing_is_queued(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[11] * 256])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[11, 5000]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[11, -1]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    # A bad prompt after good ones: all-or-nothing, the good ones are aborted.
    with pytest.raises(ValueError):
        llm.generate([[11, 12], [13, 14], [11] * 300])
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.num_kv_blocks
    assert llm.generate([[11, 12]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_abort_frees_blocks_mid_generation(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request([11] * 40, SamplingParams(max_tokens=50), request_id="victim")
    engine.add_request([12] * 30, SamplingParams(max_tokens=50), request_id="waiting")
    engine.step()
    assert engine.block_pool.num_free_blocks < engine.num_kv_blocks
    assert engine.abort_request("victim") and engine.abort_request("waiting")
    assert not engine.abort_request("victim")  # already gone
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free_blocks == engine.num_kv_blocks
    assert engine.step() == []


def test_duplicate_request_id_is_refused(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request([11, 12], request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([11, 12], request_id="dup")
    engine.abort_request("dup")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_refused(make_checkpoint, tmp_path: Path) -> None:
    model = _copy(make_checkpoint("llama"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"architectures .*GPT2LMHeadModel.* not supported"):
        LLM(model)


def test_missing_tensor_is_refused(make_checkpoint, tmp_path: Path) -> None:
    model = _copy(make_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.qkv_proj"):
        LLM(model)


def test_wrong_shape_is_refused(make_checkpoint, tmp_path: Path) -> None:
    model = _copy(make_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        LLM(model)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"num_kv_blocks": 2}, "num_kv_blocks"),
    ],
)
def test_bad_engine_config_names_the_field(make_checkpoint, config: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(make_checkpoint("llama"), **config)
