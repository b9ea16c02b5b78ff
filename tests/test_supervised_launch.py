"""Launching as an operator would: flags checked before anything starts, expected
failures in one line, a component that dies at start-up fails the launch, and one that
dies later is restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tandem.cli.launcher import LocalCluster
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, free_port

pytestmark = pytest.mark.timeout(300)


def _tandem(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


def test_serve_refuses_settings_that_cannot_work_before_starting_anything(model_dir) -> None:
    too_small = ("--worker-arg=--num-kv-blocks=2", "--worker-arg=--max-model-len=1024")
    result = _tandem(
        "serve", "--model", str(model_dir), "--grpc-port", str(free_port()), *too_small
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tandem serve: error: prefill workers: the KV cache holds 2 blocks of 16 tokens, "
        "fewer than one sequence of max_model_len=1024 needs (64); raise num_kv_blocks / "
        "kv_cache_memory_gb or lower max_model_len"
    ]
    assert "starting" not in result.stdout  # no process was launched


def test_serve_checks_pass_through_flags_with_the_components_parser(model_dir) -> None:
    result = _tandem(
        "serve", "--model", str(model_dir), "--prefill-worker-arg=--drain-migrate-after=5"
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: tandem prefill-worker")
    assert "unrecognized arguments: --drain-migrate-after=5" in result.stderr


def test_a_worker_with_a_bad_setting_says_so_in_one_line(model_dir, redis_url) -> None:
    result = _tandem(
        "decode-worker",
        *("--model", str(model_dir), "--redis-url", redis_url),
        *("--num-kv-blocks", "2", "--max-model-len", "1024"),
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "tandem decode-worker: error: the KV cache holds 2 blocks" in result.stderr


def test_a_component_that_dies_at_start_up_fails_the_launch(model_dir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _tandem(
            "serve", "--model", str(model_dir), "--grpc-port", str(port), "--port", str(free_port())
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "tandem serve: error: router exited with code 1" in result.stderr


def test_a_component_that_dies_later_is_restarted(model_dir, redis_url, tmp_path) -> None:
    spec = cluster_spec(model_dir, redis_url, tmp_path, "restart", num_prefill=0, restart=True)
    with LocalCluster(spec) as cluster:
        first = cluster.children["decode-0"]
        os.kill(first.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while cluster.children["decode-0"] is first:
            assert time.monotonic() < deadline, "decode-0 was not restarted"
            time.sleep(0.2)
        cluster.wait_ready(["decode-0"], timeout_s=60)  # registered again, at a new port
        assert cluster.num_restarts == 1
        sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        while True:  # the router follows the registry within a poll interval
            try:
                (result,) = asyncio.run(complete_all(cluster.router_address, [[5, 6, 7]], sampling))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() < deadline, "the restarted worker got no traffic"
                time.sleep(0.2)
        assert len(result.token_ids) == 4


def test_secrets_stay_off_command_lines_and_out_of_messages(model_dir) -> None:
    from tandem.cli.launcher import ClusterSpec
    from tandem.common.redis_server import redacted_url

    url = "redis://:s3cret@10.0.0.1:6379/0"
    cluster = LocalCluster(ClusterSpec(model_dir=str(model_dir), redis_url=url))
    commands = [cluster.commands.router(), cluster.commands.worker("decode", "decode-0")]
    assert not any("s3cret" in arg for command in commands for arg in command)
    assert redacted_url(url) == "redis://:***@10.0.0.1:6379/0"
    assert redacted_url("rediss://app:pw@redis.internal/2") == "rediss://app:***@redis.internal/2"
    assert redacted_url("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
