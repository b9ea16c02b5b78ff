"""The import boundaries: the shared core and the router run without torch, the shared
core depends on no component, and block hashes agree across processes whatever their
``PYTHONHASHSEED``.

Each check walks the packages, so a module added later is covered without editing this
file. Imports run in a fresh interpreter where ``import torch`` fails outright, so even a
lazy import at module level shows.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import pytest

import tandem.cli
import tandem.common
import tandem.router

TORCH_FREE_ENGINE_MODULES = [
    "tandem.engine",
    "tandem.engine.scheduler",
    "tandem.engine.block_pool",
    "tandem.engine.kv_cache_manager",
    "tandem.engine.request",
    "tandem.engine.stopping",
    "tandem.kvtransfer.leases",
    "tandem.kvtransfer.errors",
]
"""The torch-free parts of the torch packages: what the scheduler decides with."""

CORE_MAY_IMPORT = ("tandem.common", "tandem.protos")
ROUTER_MAY_IMPORT = ("tandem.router", *CORE_MAY_IMPORT)


def _modules(package) -> list[str]:
    walk = pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")
    return [package.__name__, *(m.name for m in walk if not m.name.endswith("__main__"))]


def _import_without_torch(modules: list[str]) -> list[str]:
    """Import ``modules`` in a fresh interpreter without torch; returns every ``tandem.*``
    module loaded as a result."""
    code = (
        "import json, sys\nsys.modules['torch'] = None\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(n for n in sys.modules if n.startswith('tandem.'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _outside(loaded: list[str], allowed: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if not any(m == a or m.startswith(a + ".") for a in allowed)]


def test_the_shared_core_imports_no_torch_and_no_component() -> None:
    modules = _modules(tandem.common)
    assert {"tandem.common.hashing", "tandem.common.registry.watcher"} <= set(modules)
    assert _outside(_import_without_torch(modules), CORE_MAY_IMPORT) == []


def test_the_router_imports_no_torch_engine_or_worker() -> None:
    modules = _modules(tandem.router)
    assert {"tandem.router.kv_index.indexer", "tandem.router.routing.prefix_aware"} <= set(modules)
    assert _outside(_import_without_torch(modules), ROUTER_MAY_IMPORT) == []


def test_the_cli_imports_its_components_only_when_a_command_runs() -> None:
    modules = _modules(tandem.cli)
    assert "tandem.cli.serve" in modules
    loaded = _import_without_torch(modules)
    # tandem.ray.spec: the plain dataclasses Ray flags parse into (Ray itself is not imported)
    allowed = {"tandem.ray", "tandem.ray.spec"}
    assert set(_outside(loaded, ("tandem.cli", *CORE_MAY_IMPORT))) <= allowed


@pytest.mark.parametrize("module", TORCH_FREE_ENGINE_MODULES)
def test_scheduling_modules_import_without_torch(module: str) -> None:
    _import_without_torch([module])


def test_block_hashes_agree_across_processes() -> None:
    code = (
        "from tandem.common.hashing import hash_blocks\n"
        "print(','.join(h.hex() for h in hash_blocks(list(range(1000)), 16)))"
    )
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    hashes = outputs.pop().strip().split(",")
    assert len(hashes) == 1000 // 16 and len(set(hashes)) == len(hashes)
