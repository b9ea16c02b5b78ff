"""What the commands share: the help format, the flags every server process takes, and
flag types. Torch-free, so ``tandem --help`` stays instant.

Enumerations are spelled out here rather than read from the engine (which imports
torch); ``tests/test_cli.py`` checks that they match the engine's own enums.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.common.tls import InternalTLS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class CommandError(Exception):
    """A failure a command expects and reports in one line (e.g. a cluster that did
    not start)."""


def is_expected(err: BaseException) -> bool:
    """Whether ``err`` is reported as one line rather than a traceback: a bad setting
    (``ValueError``), a file, port or connection (``OSError``), Redis unreachable, or a
    ``CommandError``."""
    if isinstance(err, ValueError | OSError | CommandError):
        return True
    return type(err).__module__.startswith("redis.")


DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("cpu", "sdpa", "torch", "flash")
LINEAR_BACKENDS = ("onednn", "native", "torch")
QUANTIZATIONS = ("int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # fp8_e4m3: vLLM's name for fp8
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
SPECULATIVE_METHODS = ("ngram", "draft")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help where the default is a value. A flag
    whose default is ``None`` ("decided elsewhere", e.g. by the engine from the machine),
    a switch that is off, and a help text that already names its default are left as
    written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", [])
        if unset or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def add_command(
    subparsers: argparse._SubParsersAction, name: str, summary: str, description: str = ""
) -> argparse.ArgumentParser:
    """A subcommand with the shared help format; ``args.parser`` is the subcommand's
    parser (for usage errors found after parsing)."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=plain(description or summary),
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(parser=parser)
    return parser


def plain(text: str) -> str:
    """A docstring line as terminal text (no reST literal markup)."""
    return text.replace("``", "")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """Flags every server process (router and workers) takes."""
    g = parser.add_argument_group("model and cluster")
    g.add_argument("--model", required=True, help="HuggingFace checkpoint directory")
    g.add_argument(
        "--model-name",
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="served model name (default: the directory's name); the router also answers "
        "to any further names given (vLLM's --served-model-name); the registry uses the first",
    )
    g.add_argument(
        "--redis-url",
        default=os.environ.get("TANDEM_REDIS_URL"),
        help="Redis holding the worker registry and KV events (default: $TANDEM_REDIS_URL)",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument(
        "--health-port",
        type=int,
        help="also answer gRPC health (readiness and liveness) alone, in plaintext, on this "
        "port: for probes that cannot do mutual TLS, e.g. a kubelet's (default: none)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus GET /metrics here, plaintext (0: any free port; default: off)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds the calls in flight may still run after the process "
        "stops taking new ones (a worker leaves the registry first)",
    )
    g.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="logging threshold")
    add_tracing_option(g)
    from tandem.cli.config_file import add_config_option

    add_config_option(parser)


def add_tracing_option(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export OpenTelemetry traces here (vLLM's flag), e.g. http://collector:4317; "
        "the OTEL_* variables apply (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or "
        "http/protobuf, headers, OTEL_SERVICE_NAME); default: $OTEL_EXPORTER_OTLP_TRACES_"
        "ENDPOINT, else off (needs the extra tandem[otel])",
    )


def setup_tracing(args: argparse.Namespace) -> None:
    """Traces to ``--otlp-traces-endpoint``, named after the command (``tandem-router``,
    ``tandem-decode-worker``, ...); a missing extra is a one-line error."""
    from tandem.common import tracing

    try:
        tracing.setup(f"tandem-{args.command}", args.otlp_traces_endpoint)
    except ValueError as err:
        raise CommandError(str(err)) from None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)


def require_redis(args: argparse.Namespace) -> None:
    if not args.redis_url:
        raise SystemExit(
            "error: --redis-url is required (or run the whole cluster with `tandem serve`)"
        )


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def quantization_group_size(text: str) -> int:
    """An int4 group size: one of ``QUANTIZATION_GROUP_SIZES``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value not in QUANTIZATION_GROUP_SIZES:
        sizes = ", ".join(str(v) for v in QUANTIZATION_GROUP_SIZES)
        raise argparse.ArgumentTypeError(f"must be one of {sizes}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def boolean(text: str) -> bool:
    """``true``/``false`` (also ``yes``/``no``, ``1``/``0``): a switch that takes a value, so
    it travels through ``tandem serve --worker-arg=--flag=VALUE`` like every engine flag."""
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def float_or_off(text: str) -> float | str:
    """A number, or the word 'off' (a flag that turns a guard off)."""
    if text == "off":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def add_internal_tls_options(parser: argparse.ArgumentParser, *, router: bool) -> None:
    """Mutual TLS between Tandem's processes. A worker's port is internal, so its
    ``--ssl-certfile``/``--ssl-keyfile`` are its identity as a server and as a client;
    the router's public-port pair is separate (``--internal-certfile`` defaults to it)."""
    g = parser.add_argument_group(
        "mutual TLS between components",
        "With --ssl-ca-certs every internal link (router to workers, decode to prefill "
        "KV control) is TLS both ways: peers must present a certificate this CA signed. "
        "`tandem certs DIR` makes a development CA and certificates.",
    )
    g.add_argument(
        "--ssl-ca-certs", type=Path, help="the internal CA's certificates, PEM (default: off)"
    )
    if router:
        g.add_argument(
            "--internal-certfile",
            type=Path,
            help="certificate the router presents to workers (default: --ssl-certfile)",
        )
        g.add_argument(
            "--internal-keyfile", type=Path, help="its private key (default: --ssl-keyfile)"
        )
    else:
        g.add_argument("--ssl-certfile", type=Path, help="this worker's certificate chain, PEM")
        g.add_argument("--ssl-keyfile", type=Path, help="its private key, PEM")
    g.add_argument(
        "--ssl-server-name",
        help="verify peers' certificates against this name instead of the host they are "
        "reached at (e.g. tandem-internal, in every `tandem certs` certificate)",
    )


def internal_tls(args: argparse.Namespace) -> InternalTLS | None:
    """The internal mTLS settings given, checked (every file read); usage errors exit 2."""
    from tandem.common.tls import InternalTLS

    certfile = getattr(args, "internal_certfile", None) or args.ssl_certfile
    keyfile = getattr(args, "internal_keyfile", None) or args.ssl_keyfile
    cert_flags = "--internal-certfile" if hasattr(args, "internal_certfile") else "--ssl-certfile"
    if args.ssl_ca_certs is None:
        if hasattr(args, "internal_certfile") and (args.internal_certfile or args.internal_keyfile):
            args.parser.error("--internal-certfile/--internal-keyfile need --ssl-ca-certs")
        if args.ssl_server_name is not None:
            args.parser.error("--ssl-server-name needs --ssl-ca-certs")
        if not hasattr(args, "internal_certfile") and (args.ssl_certfile or args.ssl_keyfile):
            args.parser.error("a worker's --ssl-certfile/--ssl-keyfile need --ssl-ca-certs")
        return None
    if certfile is None or keyfile is None:
        args.parser.error(f"--ssl-ca-certs needs this process's certificate and key ({cert_flags})")
    return InternalTLS(args.ssl_ca_certs, certfile, keyfile, args.ssl_server_name).check()
