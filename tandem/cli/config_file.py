"""``--config FILE.yaml``: a server command's flags from a YAML file, as ``vllm serve
--config`` reads one.

Each key is a flag's long name without the dashes (``max-model-len: 4096``; underscores
work too), each value what the flag takes: a switch is ``true`` / ``false``, a flag
taking several values (``served-model-name``) or given several times (``worker-arg``)
a list. Flags on the command line win over the file's. An unknown key, or a value of
the wrong shape, is a usage error naming the file and the key.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMANDS = frozenset({"serve", "router", "prefill-worker", "decode-worker"})
"""The commands that take ``--config``."""


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from a YAML file (vLLM's --config): keys are flag names without "
        "the dashes, e.g. 'max-model-len: 4096'; flags given on the command line win",
    )


def expand(argv: Sequence[str], subcommands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """``argv`` with each ``--config FILE`` replaced by the file's flags, put first so
    that the command line's own flags override them."""
    argv = list(argv)
    if not argv or argv[0] not in COMMANDS:
        return argv
    parser = subcommands[argv[0]]
    rest, files = _take_config(argv[1:], parser)
    flags = [flag for path in files for flag in _flags(path, parser)]
    return [argv[0], *flags, *rest]


def _take_config(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[Path]]:
    rest, files = [], []
    it = iter(argv)
    for token in it:
        if token == "--config":
            value = next(it, None)
            if value is None:
                parser.error("--config needs a file")
            files.append(Path(value))
        elif token.startswith("--config="):
            files.append(Path(token.split("=", 1)[1]))
        else:
            rest.append(token)
    return rest, files


def _flags(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    import yaml

    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        parser.error(f"--config {path}: {err.strerror or err}")
    except yaml.YAMLError as err:
        parser.error(f"--config {path}: not YAML: {err}")
    if settings is None:
        return []
    if not isinstance(settings, dict):
        parser.error(f"--config {path}: must be a mapping of flag names to values")
    options = parser._option_string_actions
    out: list[str] = []
    for key, value in settings.items():
        flag = f"--{str(key).replace('_', '-')}"
        action = options.get(flag)
        if action is None or flag in ("--config", "--help"):
            parser.error(f"--config {path}: unknown setting {key!r} (no {flag} flag)")
        out += _tokens(flag, value, action, options, lambda why, k=key: parser.error(
            f"--config {path}: {k}: {why}"
        ))  # fmt: skip
    return out


def _tokens(
    flag: str,
    value: Any,
    action: argparse.Action,
    options: dict[str, argparse.Action],
    error: Any,
) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            error("a switch: give true or false")
        return [flag] if value == isinstance(action, argparse._StoreTrueAction) else []
    if isinstance(value, bool):
        negation = f"--no-{flag[2:]}"
        if not value and negation in options:
            return [negation]
        return [flag] if value and action.nargs == "?" else [f"{flag}={str(value).lower()}"]
    if isinstance(action, argparse._AppendAction):  # flag=value: a value may start with "-"
        items = value if isinstance(value, list) else [value]
        return [f"{flag}={_text(item)}" for item in items]
    if isinstance(value, list):
        if action.nargs not in ("+", "*"):
            error("takes one value, not a list")
        return [flag, *(_text(item) for item in value)]
    if isinstance(value, dict):
        error("takes a value, not a mapping")
    return [f"{flag}={_text(value)}"]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
