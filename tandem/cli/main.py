"""The ``tandem`` command line.

Each subcommand lives in its own module and registers itself with ``add_parser``; this
file only wires them together. The modules import their component (torch, the router,
the workers) only when the command runs, so ``tandem --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem.cli import (
    certs,
    config_file,
    generate,
    make_lora,
    make_model,
    planner,
    quantize,
    router,
    scale,
    serve,
    worker,
)
from tandem.cli.options import is_expected, plain

_SUBCOMMANDS = (
    serve,
    scale,
    router,
    worker,
    planner,
    generate,
    make_model,
    make_lora,
    quantize,
    certs,
)
EXIT_INTERRUPTED = 130
"""In the order ``tandem --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, parsed (a server command's ``--config FILE.yaml`` expanded into
    flags first); a usage error exits 2 with the subcommand's usage."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    argv = config_file.expand(sys.argv[1:] if argv is None else argv, dict(sub.choices))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. An expected failure (a bad setting, a missing file, a component
    that died at start-up, an unreachable service) is one line on stderr and exit 1;
    its traceback shows only with ``--log-level DEBUG``."""
    args = parse(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as err:
        if not is_expected(err) or getattr(args, "log_level", "INFO") == "DEBUG":
            raise
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 1


def _version() -> str:
    from tandem import __version__

    return f"tandem {__version__}"


if __name__ == "__main__":
    sys.exit(main())
