"""Ray is an optional extra (``tandem[ray]``): installing Tandem pulls no Ray, nothing
outside the Ray commands imports it, and those commands say in one line what to
install when it is missing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ray_is_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split("[")[0].split(">")[0].strip() for d in project["dependencies"]]
    assert "ray" not in names
    assert any(d.startswith("pydantic") for d in project["dependencies"])  # imported directly
    extras = project["optional-dependencies"]
    assert any(d.startswith("ray[default]") for d in extras["ray"])
    assert any(d.startswith("ray[default]") for d in extras["test"])  # the Ray tests


def test_serving_without_ray_imports_no_ray() -> None:
    code = (
        "import sys\n"
        "import tandem.cli.main, tandem.cli.serve, tandem.cli.launcher, tandem.cli.scale\n"
        "import tandem.router.main, tandem.engine.llm, tandem.decode_worker.main\n"
        "import tandem.prefill_worker.main, tandem.planner\n"
        "from tandem.cli.main import build_parser\n"
        "build_parser().parse_args(['serve', '--ray', '--ray-address', 'auto'])\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["serve", "--ray", "--model", "m"], "tandem serve --ray"),
        (["scale", "--role", "decode", "--replicas", "1"], "tandem scale"),
    ],
)
def test_ray_commands_without_ray_say_what_to_install(tmp_path: Path, argv, command) -> None:
    """A ``ray`` package that fails to import stands for Ray not being installed (it is
    installed for the tests)."""
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == (
        f"{command}: error: Ray is not installed; it is optional: pip install 'tandem[ray]'"
    )
