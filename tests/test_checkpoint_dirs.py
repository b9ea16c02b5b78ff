"""Real HuggingFace checkpoint directories: sharded weights behind an index (stray files
beside them ignored), the sampling defaults of ``generation_config.json`` (offline, over
gRPC and over the OpenAI API, a request's own values winning), one-line errors naming a
missing or broken file, and a context fitted to a KV pool too small for the model's."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from tandem.cli.main import main as tandem_main
from tandem.common.generation_config import SamplingDefaults
from tandem.common.model_config import ModelConfig
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerRole
from tandem.common.registry.records import (
    WorkerLoad,
    WorkerRecord,
    decode_record,
    encode_record,
)
from tandem.common.sampling_params import SamplingParams
from tandem.common.tokenizer import Tokenizer
from tandem.common.wire import sampling_from_proto, sampling_to_proto
from tandem.engine import LLM
from tandem.engine.config import EngineConfig, fit_kv_pool, resolve_runtime
from tandem.engine.llm_engine import check_config, kv_layout
from tandem.engine.quantization.checkpoint import quantize_checkpoint
from tandem.engine.quantization.scheme import QuantizationConfig, QuantMethod
from tandem.protos import common_pb2, generation_pb2
from tandem.router.main import workers_max_model_len
from tandem.router.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.validation import InvalidRequest, RequestValidator
from tests.hf_reference import random_prompts

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
LLAMA_31_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 4096, (5, 30), seed=11)


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the unsharded checkpoint."""
    return _greedy(model_dir, prompts)


def _greedy(model: Path, prompts: list[list[int]], **config: object) -> list[list[int]]:
    with LLM(model, **(SMALL | config)) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard(model: Path) -> None:
    """Split ``model.safetensors`` into ``SHARDS`` named by an index, as HF saves a large
    model, and remove it."""
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard, part in zip(SHARDS, (names[::2], names[1::2]), strict=True):
        save_file({n: tensors[n] for n in part}, model / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "model.safetensors").unlink()


def _add_strays(model: Path, weights_from: Path) -> None:
    """A consolidated ``model.safetensors`` with wrong values and an unknown tensor beside
    the shards, and an unrelated ``*.safetensors``: a loader that read them would change
    the model or fail on the unknown name."""
    wrong = {n: -t for n, t in load_file(weights_from / "model.safetensors").items()}
    save_file(
        {**wrong, "stray.extra": wrong["model.norm.weight"].clone()}, model / "model.safetensors"
    )
    save_file({"lm_head.weight": wrong["lm_head.weight"]}, model / "adapter.safetensors")


@pytest.fixture(scope="module")
def sharded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = _copy(model_dir, tmp_path_factory.mktemp("sharded") / "m")
    _shard(model)
    _add_strays(model, model_dir)
    return model


# --- sharded weights -----------------------------------------------------------------------


def test_a_sharded_checkpoint_loads_only_the_shards_its_index_names(
    sharded: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert _greedy(sharded, prompts) == reference


def test_tandem_quantize_reads_the_indexed_shards_and_writes_its_own_index(
    sharded: Path, model_dir: Path, tmp_path: Path, prompts: list[list[int]]
) -> None:
    out = tmp_path / "int8"
    quantize_checkpoint(sharded, out, QuantizationConfig(QuantMethod.INT8))
    assert sorted(p.name for p in out.glob("*.safetensors")) == list(SHARDS)
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.qweight" in weight_map
    assert "stray.extra" not in weight_map
    assert _greedy(out, prompts) == _greedy(model_dir, prompts, quantization="int8")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: (m / SHARDS[1]).unlink(), f"names shard {SHARDS[1]}, which is not in"),
        (lambda m: (m / INDEX).write_text("{not json"), f"{INDEX} is not valid JSON"),
        (lambda m: (m / INDEX).write_text('{"metadata": {}}'), f"{INDEX} has no weight_map"),
        (
            lambda m: (m / SHARDS[0]).write_bytes((m / SHARDS[0]).read_bytes()[:1000]),
            f"{SHARDS[0]} is not a readable safetensors file",
        ),
    ],
    ids=["missing-shard", "index-not-json", "index-without-map", "truncated-shard"],
)
def test_a_broken_sharded_checkpoint_is_one_error_naming_the_file(
    sharded: Path, tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    model = _copy(sharded, tmp_path / "m")
    damage(model)
    with pytest.raises(ValueError, match=message) as info:
        LLM(model, **SMALL)
    assert "\n" not in str(info.value)


# --- generation_config.json sampling defaults ------------------------------------------------


def _with_generation_config(model_dir: Path, dst: Path, **fields: object) -> Path:
    model = _copy(model_dir, dst)
    path = model / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return model


@pytest.fixture(scope="module")
def recommending(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint recommending sampling values, ``do_sample: false`` beside them."""
    return _with_generation_config(
        model_dir,
        tmp_path_factory.mktemp("gen") / "m",
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        max_new_tokens=7,
        do_sample=False,
    )


RECOMMENDED = SamplingParams(
    temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7
)


def test_the_file_gives_the_defaults_vllm_takes_and_do_sample_is_ignored(
    recommending: Path,
) -> None:
    defaults = SamplingDefaults.from_file(recommending / "generation_config.json")
    assert defaults.sampling_params() == RECOMMENDED


def test_the_made_checkpoints_recommend_nothing(model_dir: Path) -> None:
    """Their file holds only token ids and ``do_sample: false``: greedy tests stay as
    they were."""
    assert SamplingDefaults.from_file(model_dir / "generation_config.json").given() == {}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_a_bad_recommended_value_names_the_file_and_key(
    tmp_path: Path, fields: dict, message: str
) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}"):
        SamplingDefaults.from_file(path)


def test_top_k_zero_means_no_top_k_as_in_transformers(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"top_k": 0, "temperature": 0.5}))
    assert SamplingDefaults.from_file(path).given() == {"temperature": 0.5}


def test_offline_generate_without_params_uses_the_model_defaults(
    model_dir: Path, tmp_path: Path, prompts: list[list[int]]
) -> None:
    greedy_five = _with_generation_config(
        model_dir, tmp_path / "m", temperature=0, max_new_tokens=5
    )
    with LLM(greedy_five, **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=5)
        explicit = SamplingParams(temperature=0, max_tokens=5)
        expected = [o.token_ids for o in llm.generate(prompts, explicit)]
        assert [o.token_ids for o in llm.generate(prompts)] == expected
        # Given parameters are used as given, as in vLLM: nothing of the model's is mixed in.
        (given,) = llm.generate(prompts[0], SamplingParams(max_tokens=9, ignore_eos=True))
        assert len(given.token_ids) == 9


def test_offline_generation_config_vllm_ignores_the_file(recommending: Path) -> None:
    with LLM(recommending, generation_config="vllm", **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_offline_generation_config_may_name_another_directory(
    model_dir: Path, recommending: Path
) -> None:
    with LLM(model_dir, generation_config=str(recommending), **SMALL) as llm:
        assert llm.get_default_sampling_params() == RECOMMENDED


@pytest.fixture(scope="module")
def validator(recommending: Path) -> RequestValidator:
    return RequestValidator.from_dir(recommending, "m")


def _grpc(**sampling: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt="hello", sampling=common_pb2.SamplingParams(**sampling)
    )


def _resolved(validator: RequestValidator, request: generation_pb2.GenerateRequest):
    """What the router resolves a request's sampling to, checked to reach the workers
    whole: a worker, which applies no defaults, reads the same from the wire."""
    sampling = validator.validate(request).sampling
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(sampling).SerializeToString())
    assert sampling_from_proto(wire) == sampling
    return sampling


def test_grpc_fields_left_unset_take_the_model_defaults(validator: RequestValidator) -> None:
    assert _resolved(validator, _grpc()) == RECOMMENDED


def test_grpc_fields_a_request_sets_win_even_at_tandem_default_values(
    validator: RequestValidator,
) -> None:
    sampling = _resolved(
        validator, _grpc(temperature=1.0, min_p=0.0, max_tokens=16, repetition_penalty=1.0)
    )
    assert sampling == SamplingParams(top_p=0.9, top_k=20, max_tokens=16)


def test_openai_fields_left_out_take_the_model_defaults(validator: RequestValidator) -> None:
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert _resolved(validator, chat.requests()[0]) == RECOMMENDED
    sent = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=0, min_p=0, max_tokens=3
    )
    assert _resolved(validator, sent.requests()[0]) == SamplingParams(
        temperature=0, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=3
    )
    # /v1/completions' max_tokens is 16 when left out (OpenAI's default, as in vLLM).
    (completion,) = CompletionRequest(prompt="hi").requests()[0]
    assert _resolved(validator, completion) == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=16
    )


def test_router_generation_config_vllm_ignores_the_file(recommending: Path) -> None:
    plain = RequestValidator.from_dir(recommending, "m", generation_config="vllm")
    assert _resolved(plain, _grpc()) == SamplingParams()


def test_tandem_router_takes_generation_config(recommending: Path) -> None:
    from tandem.cli.main import parse
    from tandem.cli.router import router_options

    common = ["router", "--model", str(recommending), "--redis-url", "redis://unused"]
    assert router_options(parse(common)).generation_config == "auto"
    assert router_options(parse([*common, "--generation-config", "vllm"])).generation_config == (
        "vllm"
    )


# --- missing and broken files --------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_a_missing_required_file_is_one_error_naming_it(
    model_dir: Path, tmp_path: Path, name: str
) -> None:
    model = _copy(model_dir, tmp_path / "m")
    (model / name).unlink()
    with pytest.raises(
        ValueError, match=f"^{re.escape(f'model directory {model} has no {name}')}$"
    ):
        RequestValidator.from_dir(model, "m")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_optional_files_may_be_missing(model_dir: Path, tmp_path: Path, name: str) -> None:
    model = _copy(model_dir, tmp_path / "m")
    (model / name).unlink()
    assert RequestValidator.from_dir(model, "m").sampling_defaults == SamplingDefaults()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer.json", "{not json", "is not a tokenizers file"),
        ("tokenizer_config.json", "{not json", "is not valid JSON"),
        ("config.json", "[1, 2]", "must hold a JSON object, not list"),
        ("config.json", "\xff\xfe", "is not valid JSON"),
        ("generation_config.json", "", "is not valid JSON"),
    ],
)
def test_a_broken_file_is_one_error_naming_it(
    model_dir: Path, tmp_path: Path, name: str, content: str, message: str
) -> None:
    model = _copy(model_dir, tmp_path / "m")
    (model / name).write_bytes(content.encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{re.escape(str(model / name))} {message}") as info:
        RequestValidator.from_dir(model, "m")
    assert "\n" not in str(info.value)


def test_the_engine_and_the_commands_report_a_missing_tokenizer_in_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _copy(model_dir, tmp_path / "m")
    (model / "tokenizer.json").unlink()
    expected = f"model directory {model} has no tokenizer.json"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        Tokenizer.from_dir(model)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        LLM(model, **SMALL)
    # The router fails before it connects to Redis; `tandem serve` before it starts anything.
    router = ["router", "--model", str(model), "--redis-url", "redis://127.0.0.1:9", "--port", "0"]
    assert tandem_main(router) == 1
    assert capsys.readouterr().err == f"tandem router: error: {expected}\n"
    assert tandem_main(["serve", "--model", str(model), "--redis-url", "redis://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == f"tandem serve: error: router: {expected}\n"


# --- max_model_len fitted to the KV pool ---------------------------------------------------

TINY_POOL_GB = 0.001
"""About 1 MiB: 65 blocks of the tiny model's 16 KiB (float32, 4 layers, 2 KV heads of
16): 1,040 tokens, below its 2,048 positions."""


def test_the_context_is_fitted_to_a_pool_too_small_for_it(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.engine.config"):
        llm = LLM(model_dir, dtype="float32", kv_cache_memory_gb=TINY_POOL_GB)
    with llm:
        fitted = llm.engine.runtime.max_model_len
        assert fitted == llm.engine.num_kv_blocks * 16 < 2048
        assert f"Auto-fit max_model_len: reduced from 2048 to {fitted}" in caplog.text
        assert llm.engine.scheduler.config.max_model_len == fitted
        out = llm.generate([[11] * (fitted - 1)], SamplingParams(max_tokens=5, ignore_eos=True))
        assert (len(out[0].token_ids), out[0].finish_reason) == (1, "length")
        with pytest.raises(ValueError, match=f"max_model_len is {fitted}"):
            llm.generate([[11] * fitted])


def test_the_default_pool_is_fitted_too(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.engine.config as engine_config

    monkeypatch.setattr(engine_config, "DEFAULT_CPU_KV_CACHE_GB", TINY_POOL_GB)
    config = EngineConfig(str(model_dir), dtype="float32", enable_chunked_prefill=False)
    model = ModelConfig.from_dir(model_dir)
    runtime = resolve_runtime(config, model)
    assert runtime.max_num_batched_tokens == 2048  # a whole prompt in one step
    blocks, fitted = fit_kv_pool(config, runtime, kv_layout(model, runtime).bytes_per_block)
    assert fitted.max_model_len == blocks * 16 < 2048
    assert fitted.max_num_batched_tokens == max(1024, fitted.max_model_len)  # not 2,048


def test_a_max_model_len_that_does_not_fit_stays_an_error_naming_both(model_dir: Path) -> None:
    config = EngineConfig(
        str(model_dir), dtype="float32", kv_cache_memory_gb=TINY_POOL_GB, max_model_len=2048
    )
    with pytest.raises(ValueError, match=r"holds 65 blocks of 16 tokens.*max_model_len=2048"):
        check_config(config)


def _record(worker_id: str, role: WorkerRole, max_model_len: int | None) -> WorkerRecord:
    capacity = WorkerCapacity(64, 16, 8, max_model_len)
    info = WorkerInfo(worker_id, role, f"{worker_id}:1", "m", capacity)
    return WorkerRecord(info, WorkerLoad.idle(capacity))


def test_workers_advertise_their_max_model_len_in_the_registry() -> None:
    record = _record("d", WorkerRole.DECODE, 1040)
    assert decode_record(encode_record(record), "k") == record
    older = json.loads(encode_record(record))
    del older["info"]["capacity"]["max_model_len"]
    assert decode_record(json.dumps(older), "k").info.capacity.max_model_len is None


class _Watcher:
    def __init__(self, *records: WorkerRecord) -> None:
        self.records = records

    def workers(self, role: WorkerRole) -> tuple[WorkerRecord, ...]:
        return tuple(r for r in self.records if r.info.role is role)


def test_the_router_checks_prompts_against_the_workers_smallest_context(
    model_dir: Path,
) -> None:
    watcher = _Watcher(
        _record("p", WorkerRole.PREFILL, 1500),
        _record("d", WorkerRole.DECODE, 1040),
        _record("old", WorkerRole.DECODE, None),
    )
    assert workers_max_model_len(_Watcher()) is None
    validator = RequestValidator.from_dir(
        model_dir, "m", workers_max_model_len=lambda: workers_max_model_len(watcher)
    )
    assert validator.max_model_len == 1040
    validator.validate(
        generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[11] * 1039))
    )
    with pytest.raises(
        InvalidRequest, match=r"1040 tokens long, more than the 1039 .*max_model_len 1040"
    ):
        validator.validate(
            generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[11] * 1040))
        )
    own = RequestValidator.from_dir(model_dir, "m", 512, workers_max_model_len=lambda: 1040)
    assert own.max_model_len == 512  # the router's own, lower limit still holds


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[object, Path]]:
    """One decode worker on a pool too small for the model's context, serving a
    checkpoint whose generation_config.json asks for 5 greedy tokens."""
    from tandem.cli.launcher import LocalCluster
    from tests.cluster_util import cluster_spec

    root = tmp_path_factory.mktemp("served")
    model = _with_generation_config(model_dir, root / "m", temperature=0, max_new_tokens=5)
    spec = cluster_spec(
        model,
        redis_url,
        root / "logs",
        "checkpoint-dirs",
        num_prefill=0,
        worker_args=("--dtype", "float32", "--kv-cache-memory-gb", str(TINY_POOL_GB)),
    )
    with LocalCluster(spec) as running:
        yield running, model


@pytest.mark.slow
def test_a_served_model_gives_its_defaults_and_the_workers_context(served, prompts) -> None:
    from tests.cluster_util import complete_all

    cluster, model = served
    with LLM(model, dtype="float32", kv_cache_memory_gb=TINY_POOL_GB) as llm:
        fitted = llm.engine.runtime.max_model_len
        offline = [o.token_ids for o in llm.generate(prompts)]
    assert all(len(tokens) <= 5 for tokens in offline)
    assert cluster.model_info().max_model_len == fitted < 2048
    results = asyncio.run(
        complete_all(cluster.router_address, prompts, common_pb2.SamplingParams())
    )
    assert [r.token_ids for r in results] == offline
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(
            complete_all(cluster.router_address, [[11] * fitted], common_pb2.SamplingParams())
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_model_len {fitted}" in info.value.details()
