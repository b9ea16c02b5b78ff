"""The ``tandem`` command line: every flag documented, enumerations checked against the
engine's own, each role taking only its flags, defaults shown in ``--help``."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from tandem.cli import options, worker
from tandem.cli.main import build_parser, main
from tandem.common.sampling_params import SpecMethod
from tandem.engine.attention.base import AttentionBackendKind
from tandem.engine.config import _DTYPES, EngineConfig
from tandem.engine.layers.linear import LinearBackend
from tandem.engine.quantization.scheme import INT4_GROUP_SIZES, QuantMethod

SERVER = ["--model", "m", "--redis-url", "redis://x"]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``tandem ARGV`` says on stderr when it refuses its arguments (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_every_flag_of_every_command_has_help_text() -> None:
    commands = _subcommands()
    assert set(commands) == {
        "serve",
        "scale",
        "router",
        "prefill-worker",
        "decode-worker",
        "planner",
        "generate",
        "make-model",
        "make-lora",
        "quantize",
        "certs",
    }
    for name, parser in commands.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"tandem {name}: {action.option_strings or action.dest}"


def test_enumerations_match_the_engine() -> None:
    assert set(options.DTYPES) == {"auto", *_DTYPES}
    assert set(options.ATTENTION_BACKENDS) == {k.value for k in AttentionBackendKind}
    assert set(options.LINEAR_BACKENDS) == {k.value for k in LinearBackend}
    assert set(options.SPECULATIVE_METHODS) == {m.value for m in SpecMethod}
    assert set(options.QUANTIZATIONS) == {m.value for m in QuantMethod}
    assert set(options.QUANTIZATION_GROUP_SIZES) == set(INT4_GROUP_SIZES)


def test_engine_flags_name_engine_fields_and_state_their_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for flag in worker.ROLE_ENGINE_FLAGS["decode"]:
        assert flag.field in fields, flag.flag
        default = fields[flag.field].default
        stated = re.search(r"\(default: ([\w.]+)", flag.help)
        if isinstance(default, str):
            assert stated is not None and stated.group(1) == default, flag.flag
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert stated is not None and float(stated.group(1)) == default, flag.flag


def test_each_role_takes_only_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    decode_only = ["--speculative-method", "ngram", "--kv-pull-timeout", "3"]
    err = _parse_error(["prefill-worker", *SERVER, *decode_only], capsys)
    assert err.startswith("usage: tandem prefill-worker")  # the subcommand's own usage
    assert "unrecognized arguments: --speculative-method ngram --kv-pull-timeout 3" in err
    err = _parse_error(["prefill-worker", *SERVER, "--drain-migrate-after", "1"], capsys)
    assert "unrecognized arguments: --drain-migrate-after 1" in err
    assert "--num-kv-blocks" in _parse_error(["router", *SERVER, "--num-kv-blocks", "8"], capsys)
    prefill = build_parser().parse_args(["prefill-worker", *SERVER, "--lease-ttl", "5"])
    decode = build_parser().parse_args(["decode-worker", *SERVER, *decode_only])
    assert (prefill.lease_ttl, decode.kv_pull_timeout) == (5.0, 3.0)
    # Both hold KV for others to pull: a prefill its prompts, a decode its hand-overs.
    decode = build_parser().parse_args(
        ["decode-worker", *SERVER, "--lease-ttl", "5", "--drain-migrate-after", "2"]
    )
    assert (decode.lease_ttl, decode.drain_migrate_after) == (5.0, 2.0)


def test_bad_enumerated_values_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["decode-worker", *SERVER, "--dtype", "float64"], capsys)
    assert "invalid choice: 'float64'" in err and "bfloat16" in err
    err = _parse_error(["decode-worker", *SERVER, "--device", "gpu"], capsys)
    assert "expected auto, cpu, cuda or cuda:N, got 'gpu'" in err
    assert "--log-level" in _parse_error(["router", *SERVER, "--log-level", "loud"], capsys)
    err = _parse_error(["decode-worker", *SERVER, "--max-num-seqs", "0"], capsys)
    assert "--max-num-seqs: expected an integer >= 1, got 0" in err


def test_a_draft_proposer_needs_a_draft_model_and_none_turns_speculation_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _parse_error(["decode-worker", *SERVER, "--speculative-method", "draft"], capsys)
    assert err.startswith("usage: tandem decode-worker")
    assert "--speculative-method draft needs --draft-model DIR" in err
    err = _parse_error(["serve", "--model", "m", "--speculative-method", "draft"], capsys)
    assert "needs --draft-model DIR with --model" in err
    off = ["--speculative-method", "none", "--draft-model", "d", "--max-num-seqs", "2"]
    args = build_parser().parse_args(["decode-worker", *SERVER, *off])
    assert worker.engine_settings(args) == {"max_num_seqs": 2}


def test_only_the_engine_flags_given_reach_the_engine() -> None:
    args = build_parser().parse_args(
        ["decode-worker", *SERVER, "--device", "cuda:1", "--max-num-seqs", "8", "--seed", "0"]
    )
    assert worker.engine_settings(args) == {"device": "cuda:1", "max_num_seqs": 8, "seed": 0}
    EngineConfig(model="m", **worker.engine_settings(args))  # all valid engine fields


def test_kv_cache_dtype_takes_vllm_fp8_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["decode-worker", *SERVER, "--kv-cache-dtype", "fp8_e4m3"])
    settings = worker.engine_settings(args)
    assert settings == {"kv_cache_dtype": "fp8_e4m3"}
    EngineConfig(model="m", **settings)
    err = _parse_error(["decode-worker", *SERVER, "--kv-cache-dtype", "fp16"], capsys)
    assert "invalid choice: 'fp16'" in err


def test_quantize_lm_head_is_a_switch_with_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    quantized = ["--quantization", "int8", "--quantize-lm-head", "true"]
    args = build_parser().parse_args(["prefill-worker", *SERVER, *quantized])
    settings = worker.engine_settings(args)
    assert settings == {"quantization": "int8", "quantize_lm_head": True}
    assert EngineConfig(model="m", **settings).quantization_config().lm_head
    args = build_parser().parse_args(["decode-worker", *SERVER, "--quantize-lm-head", "no"])
    assert worker.engine_settings(args) == {"quantize_lm_head": False}
    err = _parse_error(["decode-worker", *SERVER, "--quantize-lm-head", "maybe"], capsys)
    assert "--quantize-lm-head: expected true or false, got 'maybe'" in err


def test_batch_invariance_is_a_switch_and_vllms_variable(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    args = build_parser().parse_args(["decode-worker", *SERVER, "--batch-invariant"])
    assert worker.engine_settings(args) == {"batch_invariant": True}
    args = build_parser().parse_args(["prefill-worker", *SERVER])
    assert worker.engine_settings(args) == {}
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert worker.engine_settings(args) == {"batch_invariant": True}
    args = build_parser().parse_args(["prefill-worker", *SERVER, "--no-batch-invariant"])
    assert worker.engine_settings(args) == {"batch_invariant": False}  # the flag wins
    with pytest.raises(ValueError, match="batch_invariant computes in float32"):
        EngineConfig(model="m", dtype="float16", batch_invariant=True)


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "gRPC port of the public API (default: 50051)" in text
    assert "(default: prefix_aware)" in text
    assert "(default: None)" not in text
    assert "``" not in text


def test_ray_settings_need_ray_and_bad_ones_are_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _parse_error(["serve", "--cpus-per-rank", "2", "--decode-node-label", "a=b"], capsys)
    assert "--cpus-per-rank, --decode-node-label: Ray settings, give --ray too" in err
    err = _parse_error(["serve", "--ray", "--log-dir", "/tmp/x"], capsys)
    assert "Ray's log folder" in err
    assert main(["serve", "--ray", "--prefill-node-label", "pool"]) == 2
    assert "--prefill-node-label takes KEY=VALUE, got 'pool'" in capsys.readouterr().err
    assert main(["serve", "--ray", "--decode-ray-resource", "big=-1"]) == 2
    assert "--decode-ray-resource 'big=-1': must be > 0" in capsys.readouterr().err
    assert main(["serve", "--ray", "--cpus-per-rank", "0"]) == 2
    assert "a rank needs a CPU or a GPU" in capsys.readouterr().err


def test_ray_flags_become_the_ray_spec() -> None:
    from tandem.cli.main import parse
    from tandem.cli.ray_flags import ray_spec

    args = parse(
        [
            *("serve", "--ray-address", "ray://head:10001", "--tensor-parallel-size", "2"),
            *("--gpus-per-rank", "1", "--kv-cache-memory-gb", "2", "--ray-namespace", "prod"),
            *("--decode-node-label", "pool=decode", "--decode-ray-resource", "big=0.5"),
        ]
    )
    spec = ray_spec(args)
    assert (spec.address, spec.namespace, spec.tensor_parallel_size) == (
        "ray://head:10001",
        "prod",
        2,
    )
    assert spec.bundles("decode") == [{"CPU": 1.0, "GPU": 1.0, "memory": 2 * 2**30, "big": 0.5}] * 2
    assert spec.label_selectors("decode") == [{"pool": "decode"}] * 2
    assert spec.bundles("prefill") == [{"CPU": 1.0, "GPU": 1.0, "memory": 2 * 2**30}] * 2


def test_scale_refuses_an_unreachable_ray_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["scale", "--role", "decode", "--replicas", "2", "--ray-address", "127.0.0.1:1"]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("tandem scale: error: cannot reach the Ray cluster at 127.0.0.1:1")
    assert _parse_error(["scale", "--role", "decode", "--replicas", "-1"], capsys).endswith(
        "--replicas must be >= 0, got -1\n"
    )


def test_serve_takes_the_redis_url_from_the_environment(monkeypatch) -> None:
    from tandem.cli.main import parse

    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:pw@redis:6379/0")
    assert parse(["serve"]).redis_url == "redis://:pw@redis:6379/0"
    monkeypatch.delenv("TANDEM_REDIS_URL")
    assert parse(["serve"]).redis_url is None


def test_serve_takes_the_model_positionally_and_vllms_engine_flags() -> None:
    """`tandem serve MODEL --max-model-len ...` as `vllm serve` takes it: each engine flag
    reaches every worker (as --worker-arg would pass it), which parses it into its
    engine's config."""
    from tandem.cli.serve import engine_flag_args

    argv = ["serve", "/ckpt", "--max-model-len", "300", "--dtype", "float32"]
    argv += ["--served-model-name", "mine", "--no-enable-prefix-caching", "--seed", "7"]
    argv += ["--enable-chunked-prefill", "--gpu-memory-utilization", "0.5"]
    args = build_parser().parse_args(argv)
    assert args.model_path == "/ckpt" and args.model_name == ["mine"]
    passed = engine_flag_args(args)
    assert passed == [
        "--dtype=float32",
        "--max-model-len=300",
        "--seed=7",
        "--enable-prefix-caching=false",
        "--enable-chunked-prefill=true",
        "--gpu-memory-utilization=0.5",
    ]
    worker_args = build_parser().parse_args(["decode-worker", *SERVER, *passed])
    settings = worker.engine_settings(worker_args)
    assert settings == {
        "dtype": "float32",
        "max_model_len": 300,
        "seed": 7,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": 0.5,
    }
    EngineConfig(model="m", **settings)  # every one is an engine field


def test_serve_refuses_vllm_flags_it_does_not_do_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for flag, reason in (("--swap-space", "no CPU swap space"), ("--trust-remote-code", "no code")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", flag, "4"] if flag == "--swap-space" else ["serve", flag])
        assert exit_info.value.code == 2
        assert f"{flag}: Tandem " in (err := capsys.readouterr().err) and reason in err
    with pytest.raises(SystemExit):
        main(["serve", "/a", "--model", "/b"])
    assert "two models: /a and --model /b" in capsys.readouterr().err


def test_chat_template_and_tool_flags_reach_the_router(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tandem serve` hands vLLM's chat and tool flags to the router, a template file by
    its absolute path; the router takes auto tool choice only with a parser."""
    from tandem.cli.router import router_options
    from tandem.cli.serve import _chat_args

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    argv = ["serve", "--chat-template", str(template), "--enable-auto-tool-choice"]
    args = build_parser().parse_args([*argv, "--tool-call-parser", "llama3_json"])
    passed = _chat_args(args)
    assert passed == [
        f"--chat-template={template}",
        "--enable-auto-tool-choice",
        "--tool-call-parser=llama3_json",
    ]
    router = build_parser().parse_args(["router", *SERVER, *passed])
    options = router_options(router)
    assert (options.chat_template, options.tool_call_parser) == (str(template), "llama3_json")
    for lonely in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(SystemExit):
            router_options(build_parser().parse_args(["router", *SERVER, *lonely]))
        assert "needs --" in capsys.readouterr().err
    assert "invalid choice: 'mistral'" in _parse_error(
        ["router", *SERVER, "--tool-call-parser", "mistral"], capsys
    )


def test_config_file_as_vllm_reads_one(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--config FILE.yaml`: flag names as keys (dashes or underscores), switches as
    booleans, lists for flags taking several values or given several times; the command
    line wins; a bad key or shape is a usage error naming the file and the key."""
    from tandem.cli.main import parse

    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /ckpt\n"
        "max-model-len: 300\n"
        "served_model_name: [mine, gpt-4o]\n"
        "enable-prefix-caching: false\n"
        "enable-chunked-prefill: true\n"
        "enable-auto-tool-choice: true\n"
        "tool-call-parser: hermes\n"
        "worker-arg: ['--max-num-seqs=8']\n"
        "port: 9000\n"
    )
    args = parse(["serve", "--config", str(config), "--port", "9100"])
    assert (args.model, args.model_name, args.port) == ("/ckpt", ["mine", "gpt-4o"], 9100)
    assert (args.engine_max_model_len, args.engine_enable_prefix_caching) == (300, False)
    assert args.engine_enable_chunked_prefill is True and args.enable_auto_tool_choice
    assert args.worker_arg == ["--max-num-seqs=8"] and args.tool_call_parser == "hermes"
    router = tmp_path / "router.yaml"
    router.write_text("model: /m\nredis-url: redis://r:6379/0\nhttp-port: 8000\n")
    assert parse(["router", f"--config={router}"]).http_port == 8000
    for text, words in (
        ("max-modle-len: 3\n", "unknown setting 'max-modle-len'"),
        ("port: [1, 2]\n", "port: takes one value, not a list"),
        ("demo: 3\n", "demo: a switch"),
        ("- a\n", "must be a mapping"),
        ("port: [\n", "not YAML"),
    ):
        config.write_text(text)
        error = _parse_error(["serve", "--config", str(config)], capsys)
        assert f"--config {config}" in error and words in error, error
    assert "No such file" in _parse_error(["serve", "--config", str(tmp_path / "x.yaml")], capsys)


def test_speculative_config_is_the_three_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli.main import parse
    from tandem.cli.serve import _speculative_args, _speculative_config

    def flags(config: str) -> list[str]:
        args = parse(["serve", "--speculative-config", config])
        return [*_speculative_config(args), *_speculative_args(args)]

    assert flags('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}') == [
        "--ngram-max-n=2", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
    ]  # fmt: skip
    assert flags('{"model": "/d", "num_speculative_tokens": 5}') == [
        "--speculative-method", "draft", "--draft-model", "/d", "--num-speculative-tokens", "5",
    ]  # fmt: skip
    worker = build_parser().parse_args(["decode-worker", *SERVER, "--ngram-max-n=2"])
    assert worker.ngram_max_n == 2  # what the decode workers are given parses
    for config, words in (
        ('{"method": "eagle", "model": "/e"}', "method 'eagle' with a model"),
        ('{"method": "ngram", "prompt_lookup_min": 2}', "'prompt_lookup_min' is not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be a positive integer"),
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
    ):
        with pytest.raises(SystemExit):
            flags(config)
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _speculative_config(
            parse(["serve", "--speculative-config", '{"method": "ngram"}', "--draft-model", "d"])
        )
    assert "give it or --speculative-method" in capsys.readouterr().err
