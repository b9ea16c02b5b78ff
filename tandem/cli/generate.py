"""``tandem generate``: stream one completion from a running router to the terminal.

The text goes to stdout as it arrives; a one-line usage summary (token counts, time to
first token, decode rate) goes to stderr at the end, so ``> out.txt`` keeps only the
completion. Only the sampling flags given are sent; the rest take the server's
defaults (the model's ``generation_config.json`` values, unless the router runs with
``--generation-config vllm``). A gRPC failure prints ``error: <CODE>: <details>`` and
exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tandem.cli.options import add_command

if TYPE_CHECKING:  # gRPC and the stubs load only when the command runs: `--help` stays instant
    from tandem.common.client import StreamTiming
    from tandem.protos import common_pb2, generation_pb2

EXIT_RPC_ERROR = 1
EXIT_INTERRUPTED = 130


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "generate",
        "stream a completion from a running Tandem router",
        __doc__.splitlines()[0],
    )
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router's HOST:PORT")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat turn")
    p.add_argument(
        "--model", default="", help="model name to check against the served one (default: any)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="most tokens to generate (default: the model's, else 16)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="0 means greedy (default: the model's, else 1.0)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="nucleus sampling: keep mass P (default: the model's, else 1.0)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="sample among the K likeliest (default: the model's, else all)",
    )
    p.add_argument(
        "--seed", type=int, metavar="N", help="seed for reproducible sampling (default: none)"
    )
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate until max tokens")
    p.add_argument(
        "--timeout", type=float, metavar="S", help="deadline for the whole stream (default: none)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="key for a router that requires one (default: $TANDEM_API_KEY)",
    )
    p.add_argument(
        "--ssl-ca-certs",
        type=Path,
        metavar="PEM",
        help="CA certificates of a router serving TLS (default: plaintext)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from tandem.common.client import Chat, StreamClock, stream_generate

    prompt = Chat((("user", args.prompt),)) if args.chat else args.prompt
    responses = stream_generate(
        args.addr,
        prompt,
        _sampling(args),
        timeout_s=args.timeout,
        model=args.model,
        api_key=args.api_key,
        root_certificates=None if args.ssl_ca_certs is None else args.ssl_ca_certs.read_bytes(),
    )
    printer = _TextPrinter(sys.stdout)
    clock = StreamClock()
    final = None
    try:
        for final in responses:
            clock.observe(final)
            printer.write(final.text)
    except grpc.RpcError as err:
        printer.end_line()
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except KeyboardInterrupt:
        responses.close()  # cancels the request on the server
        printer.end_line()
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    printer.end_line()
    if final is not None:
        print(usage_line(final, clock.finish()), file=sys.stderr)
    return 0


def usage_line(final: generation_pb2.GenerateResponse, timing: StreamTiming) -> str:
    """The stderr summary: token counts from the final message's usage, client timings."""
    from tandem.protos import common_pb2

    usage = final.usage
    reason = common_pb2.FinishReason.Name(final.finish_reason)
    parts = [
        f"prompt {usage.prompt_tokens} tokens ({usage.cached_prompt_tokens} cached)",
        f"completion {usage.completion_tokens} tokens",
    ]
    if timing.ttft_s is not None:
        parts.append(f"TTFT {timing.ttft_s * 1000:.1f} ms")
    if timing.tpot_s is not None and timing.tpot_s > 0:  # 0: every token in one message
        parts.append(f"{1 / timing.tpot_s:.1f} tok/s")
    parts.append(f"total {timing.e2e_s:.2f} s")
    parts.append(f"finish {reason.removeprefix('FINISH_REASON_').lower()}")
    return " · ".join(parts)


def _sampling(args: argparse.Namespace) -> common_pb2.SamplingParams:
    """The wire ``SamplingParams`` with only the flags the user gave."""
    from tandem.protos import common_pb2

    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    return common_pb2.SamplingParams(
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **{name: value for name, value in given.items() if value is not None},
    )


class _TextPrinter:
    """Writes streamed text at once and remembers whether the line is still open."""

    def __init__(self, out: TextIO):
        self._out = out
        self._line_open = False

    def write(self, text: str) -> None:
        if text:
            self._out.write(text)
            self._out.flush()
            self._line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """Finish the current line, so what follows starts on a line of its own."""
        if self._line_open:
            self._out.write("\n")
            self._out.flush()
            self._line_open = False
