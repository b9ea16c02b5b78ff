"""The ``tandem`` command line.

Each subcommand lives in the module that owns it and registers itself through a small
``add_parser(subparsers)`` function; this file only wires them together, and imports
the heavy ones (torch, gRPC) lazily so ``tandem --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (subcommand module, attribute holding its `add_parser`) — each module imported on demand.
_SUBCOMMANDS: tuple[str, ...] = (
    "tandem.cli.make_model",
    "tandem.cli.generate",
    "tandem.cli.components",
    "tandem.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
