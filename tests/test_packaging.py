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
