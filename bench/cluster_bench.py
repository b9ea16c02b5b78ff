"""What the cluster benchmarks (``migration.py``, ``multiturn.py``) share: a random
checkpoint when none is given, free ports, and the report's provenance and output."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path

LOG_DIR = Path("bench/results/logs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint(model: str | None, size: str, name: str) -> str:
    """``model``, or a random Llama of the ``size`` preset made now."""
    if model is not None:
        return model
    from tandem.tools.checkpoint_maker import make_model

    work = Path(tempfile.mkdtemp(prefix=f"tandem-bench-{name}-"))
    return str(make_model(work / "model", arch="llama", size=size))


def provenance(model: str | None, size: str) -> dict[str, str]:
    """Commit, machine and model, for the report."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model or f"random llama {size}",
    }


def emit(report: dict, path: Path | None) -> None:
    print(json.dumps(report))
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")
