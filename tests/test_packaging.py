"""Packaging: one top-level import name, and every package folder in the wheel.

``pyproject.toml`` maps the repository's fixed top-level folders onto ``tandem.*`` and
lists the packages explicitly. An editable install finds a subpackage missing from that
list anyway, a wheel silently leaves it out: so the list is checked against the tree.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_in_tree() -> set[str]:
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    return found


def test_the_only_top_level_import_name_is_tandem() -> None:
    top_level = importlib.metadata.distribution("tandem").read_text("top_level.txt")
    assert top_level is not None and top_level.split() == ["tandem"]
    assert all(name == "tandem" or name.startswith("tandem.") for name in SETUPTOOLS["packages"])


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    in_tree = _packages_in_tree()
    assert {"tandem.engine.spec_decode", "tandem.router.kv_index", "tandem.bench.sim"} <= in_tree
    assert in_tree == set(SETUPTOOLS["packages"])


def test_every_c_kernel_source_ships_in_the_wheel() -> None:
    """The native kernels compile from their C source at run time: a source missing from
    the package data works in a checkout and fails in an installed wheel (the fused norm /
    rotary kernels were missing until the native GEMM's source was added)."""
    data = SETUPTOOLS["package-data"]
    missing = []
    for package, folder in SETUPTOOLS["package-dir"].items():
        root = ROOT / folder
        for source in root.rglob("*.c"):
            # A pattern may sit on any package above the file (setuptools matches it
            # relative to that package's folder).
            owners = [p for p in source.parents if p.is_relative_to(root)]
            if not any(
                source.relative_to(owner).match(pattern)
                for owner in owners
                if (owner / "__init__.py").exists()
                for pattern in data.get(".".join((package, *owner.relative_to(root).parts)), [])
            ):
                missing.append(str(source.relative_to(ROOT)))
    assert missing == [], f"C sources not in [tool.setuptools.package-data]: {missing}"
