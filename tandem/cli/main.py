"""The ``tandem`` command line.

Each subcommand lives in its own module and registers itself with ``add_parser``; this
file only wires them together. The modules import their component (torch, the router,
the workers) only when the command runs, so ``tandem --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem.cli import generate, make_model, router, serve, worker
from tandem.cli.options import plain

_SUBCOMMANDS = (serve, router, worker, generate, make_model)
"""In the order ``tandem --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported with the subcommand's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.run(args) or 0)


def _version() -> str:
    from tandem import __version__

    return f"tandem {__version__}"


if __name__ == "__main__":
    sys.exit(main())
