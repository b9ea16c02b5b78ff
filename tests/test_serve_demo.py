"""The quick start's main command: ``tandem serve --demo`` brings the whole cluster up on
the built-in trained model with an embedded Redis, answers the sample request, and
leaves no process behind."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.cluster_util import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_serve_demo_answers_and_cleans_up() -> None:
    before = {p.pid for p in psutil.process_iter()}
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--demo", "--grpc-port", str(port)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"at 127.0.0.1:{port}" in result.stdout
    assert "(embedded)" in result.stdout
    assert ">>> def fibonacci(n):" in result.stdout
    assert "48 generated" in result.stdout
    # Quiet by default: a READY line per component, no INFO chatter (--log-level INFO).
    assert sum(" READY " in line for line in result.stdout.splitlines()) == 3
    # and each worker's start-up progress: what it loads, then its KV cache
    loaded = [line for line in result.stdout.splitlines() if "] LOADED in " in line]
    assert len(loaded) == 2 and all(" blocks of 16 tokens (" in line for line in loaded)
    assert " INFO " not in result.stdout + result.stderr
    # Nor a warning: at the end the router stops first, before the workers leave.
    assert "WARNING" not in result.stdout + result.stderr
    leftovers = [p.cmdline() for p in psutil.process_iter() if p.pid not in before and _is_ours(p)]
    assert leftovers == []


def _is_ours(process: psutil.Process) -> bool:
    try:
        cmd = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "tandem.cli" in cmd or "redis-server" in cmd


def test_serve_ray_demo_answers_and_leaves_nothing_running() -> None:
    """``tandem serve --ray --demo`` at TP=2: a local Ray, every component an actor, the
    answer streamed, then no Ray process, actor or Redis left."""
    pytest.importorskip("ray")
    before = {p.pid for p in psutil.process_iter()}
    port = free_port()
    command = [sys.executable, "-m", "tandem.cli", "serve", "--ray", "--demo"]
    command += ["--tensor-parallel-size", "2", "--ray-num-cpus", "4", "--grpc-port", str(port)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "(tensor-parallel size 2)" in result.stdout and "on Ray (a local Ray)" in result.stdout
    assert f"at 127.0.0.1:{port}" in result.stdout
    assert "namespace 'tandem'" in result.stdout
    assert "48 generated" in result.stdout
    deadline = time.monotonic() + 30  # Ray's last processes exit after ray.shutdown returns
    while True:
        leftovers = [_cmd(p) for p in psutil.process_iter() if p.pid not in before]
        leftovers = [c for c in leftovers if c and ("ray" in c or "tandem" in c or "redis" in c)]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert leftovers == []


def _cmd(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_serve_as_vllm_serve_is_called(make_checkpoint) -> None:
    """`tandem serve MODEL` with vLLM's flags: the positional model, --served-model-name,
    and engine flags passed on to every worker (each worker parses them: a bad one
    would stop the cluster before the answer)."""
    command = [sys.executable, "-m", "tandem.cli", "serve", str(make_checkpoint("qwen3"))]
    command += ["--served-model-name", "mine", "--max-model-len", "128", "--dtype", "float32"]
    command += ["--no-enable-prefix-caching", "--max-num-seqs", "8", "--demo"]
    command += ["--grpc-port", "0", "--port", "0"]  # free ports, as the router says them
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("tandem serving 'mine' at")]
    assert not line.split()[4].endswith(":0;") and line.split()[4].startswith("127.0.0.1:")
    # --port is the OpenAI API's, as in vllm serve
    (http,) = [x for x in result.stdout.splitlines() if x.startswith("OpenAI-compatible API")]
    assert http.startswith("OpenAI-compatible API at http://127.0.0.1:") and ":0/" not in http
    assert "48 generated" in result.stdout
