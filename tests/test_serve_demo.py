"""The quick start's main command: ``tandem serve --demo`` brings the whole cluster up on
the built-in trained model with an embedded Redis, answers the sample request, and
leaves no process behind."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from tests.cluster_util import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_serve_demo_answers_and_cleans_up() -> None:
    before = {p.pid for p in psutil.process_iter()}
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--demo", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"at 127.0.0.1:{port}" in result.stdout
    assert "(embedded)" in result.stdout
    assert ">>> def fibonacci(n):" in result.stdout
    assert "48 generated" in result.stdout
    leftovers = [p.cmdline() for p in psutil.process_iter() if p.pid not in before and _is_ours(p)]
    assert leftovers == []


def _is_ours(process: psutil.Process) -> bool:
    try:
        cmd = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "tandem.cli" in cmd or "redis-server" in cmd
