"""The scheduler, the KV bookkeeping and the shared hashing import without torch, and
block hashes agree across processes whatever their ``PYTHONHASHSEED``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TORCH_FREE_MODULES = [
    "engine.scheduler",
    "engine.block_pool",
    "engine.kv_cache_manager",
    "engine.request",
    "engine.stopping",
    "tandem.hashing",
    "tandem.sampling_params",
    "tandem.model_config",
    "tandem.tokenizer",
    "tandem.kv_events",
    "tandem.registry",
    "tandem.cli",
    "tandem.client",
    "tandem.generate_cli",
    "tandem.server_cli",
    "tandem.serve_cli",
    "tandem.launcher",
    "tandem.text_stream",
    "tandem.wire",
    "router.policy",
    "router.validation",
    "router.orchestrator",
    "router.service",
    "router.main",
]


def _run(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return result.stdout


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_imports_without_torch(module: str) -> None:
    # Make `import torch` fail outright, so even a lazy import inside the module shows.
    code = f"import sys; sys.modules['torch'] = None\nimport {module}\nprint('ok')"
    assert _run(code).strip() == "ok"


def test_block_hashes_agree_across_processes() -> None:
    code = (
        "from tandem.hashing import hash_blocks\n"
        "print(','.join(h.hex() for h in hash_blocks(list(range(1000)), 16)))"
    )
    outputs = {_run(code, PYTHONHASHSEED=seed) for seed in ("0", "1", "12345", "random")}
    assert len(outputs) == 1
    hashes = outputs.pop().strip().split(",")
    assert len(hashes) == 1000 // 16 and len(set(hashes)) == len(hashes)
