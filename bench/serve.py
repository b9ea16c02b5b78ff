"""Serving benchmark: open-loop load against a running router, latency and goodput.

    python bench/serve.py --addr HOST:PORT [--rate R|inf] [--num-requests N] \\
        [--prompt-len LO:HI] [--output-len LO:HI] [--num-prefixes K --prefix-len L] \\
        [--ttft-slo-ms MS] [--tpot-slo-ms MS] [--json OUT] [--plot OUT.png]

Asks the router (``ListModels``) for the model's vocabulary and context length, sends
random token-id prompts (``bench/loadgen.py`` says how they are drawn and timed), and
prints TTFT, TPOT and end-to-end latency (mean, p50, p90, p99), output tokens/s,
requests/s and goodput. ``--plot`` needs matplotlib, which is not a dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import grpc
from tqdm import tqdm

from tandem.bench.loadgen import (
    Distribution,
    LoadSpec,
    PlannedRequest,
    Report,
    RequestResult,
    Slo,
    plan_requests,
    run_load,
    summarize,
)
from tandem.bench.workloads import IntRange, TokenPool
from tandem.common.client import AsyncGenerationClient
from tandem.protos import generation_pb2

EXIT_USAGE = 2


class SetupError(Exception):
    """The benchmark cannot start: a message for the user, no traceback."""


def parse_range(text: str) -> IntRange:
    """``"N"`` or ``"LO:HI"`` (inclusive) as an ``IntRange``."""
    low, _, high = text.partition(":")
    try:
        return IntRange(int(low), int(high or low))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI: {err}") from err


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router")
    p.add_argument("--model", default="", help="model to benchmark (default: the only one)")
    p.add_argument("--model-dir", type=Path, help="checkpoint: leave its special ids out")
    p.add_argument("--num-requests", type=int, default=100, metavar="N")
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s, or inf")
    p.add_argument("--prompt-len", type=parse_range, default=IntRange(32, 256), metavar="LO:HI")
    p.add_argument("--output-len", type=parse_range, default=IntRange(32, 128), metavar="LO:HI")
    p.add_argument("--num-prefixes", type=int, default=0, metavar="K", help="shared prefixes")
    p.add_argument("--prefix-len", type=int, default=0, metavar="L", help="tokens per prefix")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, metavar="S", help="deadline per request")
    p.add_argument("--ttft-slo-ms", type=float, metavar="MS")
    p.add_argument("--tpot-slo-ms", type=float, metavar="MS")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the report and every request")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="latency plots (matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    return p


async def run(args: argparse.Namespace) -> int:
    """The whole benchmark; returns the exit status."""
    try:
        spec = _spec(args)
        if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
            raise SetupError("--plot needs matplotlib, which is not installed (pip install it)")
        async with AsyncGenerationClient(args.addr) as client:
            model = await _model_info(client, args.model)
            _check_fits(spec, model)
            pool = _token_pool(args.model_dir, model)
            planned = plan_requests(spec, pool)
            results, duration_s = await _run_with_progress(client, planned, args)
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    slo = Slo(_seconds(args.ttft_slo_ms), _seconds(args.tpot_slo_ms))
    report = summarize(results, duration_s, slo)
    print(format_report(report, slo, model.name, spec))
    _print_errors(results)
    if args.json is not None:
        _write_json(args.json, report, spec, model.name, results)
    if args.plot is not None:
        _plot(args.plot, results)
    return 0


def _spec(args: argparse.Namespace) -> LoadSpec:
    try:
        return LoadSpec(
            num_requests=args.num_requests,
            rate=args.rate,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            seed=args.seed,
        )
    except ValueError as err:
        raise SetupError(str(err)) from err


async def _model_info(client: AsyncGenerationClient, name: str) -> generation_pb2.ModelInfo:
    try:
        models = (await client.list_models(timeout_s=10)).models
    except grpc.aio.AioRpcError as err:
        raise SetupError(f"ListModels failed: {err.code().name}: {err.details()}") from err
    names = [m.name for m in models]
    chosen = [m for m in models if m.name == name] if name else list(models)
    if len(chosen) != 1:
        wanted = f"model {name!r}" if name else "exactly one model (or pass --model)"
        raise SetupError(f"expected {wanted}; the router serves {names}")
    return chosen[0]


def _check_fits(spec: LoadSpec, model: generation_pb2.ModelInfo) -> None:
    if spec.max_prompt_len > model.max_model_len - 1:
        raise SetupError(
            f"prompts of up to {spec.max_prompt_len} tokens do not fit {model.name!r} "
            f"(max_model_len {model.max_model_len}): shorten --prompt-len or --prefix-len"
        )


def _token_pool(model_dir: Path | None, model: generation_pb2.ModelInfo) -> TokenPool:
    """Ids from the checkpoint minus its special ids, else the router's whole vocabulary."""
    if model_dir is None:
        return TokenPool.from_vocab(model.vocab_size)
    pool = TokenPool.from_checkpoint(model_dir)
    if max(pool.allowed) >= model.vocab_size:
        raise SetupError(f"--model-dir {model_dir} does not match the served {model.name!r}")
    return pool


async def _run_with_progress(
    client: AsyncGenerationClient, planned: Sequence[PlannedRequest], args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    with tqdm(total=len(planned), unit="req", disable=args.no_progress or None) as bar:
        return await run_load(
            client,
            planned,
            temperature=args.temperature,
            timeout_s=args.timeout,
            on_done=lambda result: bar.update(),
        )


def format_report(report: Report, slo: Slo, model: str, spec: LoadSpec) -> str:
    """The human-readable report."""
    rate = "all at once" if math.isinf(spec.rate) else f"{spec.rate:g} req/s"
    lines = [
        f"model {model!r}, {spec.num_requests} requests, {rate}",
        f"completed {report.num_completed}, failed {report.num_failed}"
        f" in {report.duration_s:.2f} s",
        f"request throughput  {report.request_throughput:10.2f} req/s",
        f"output throughput   {report.output_throughput:10.1f} tok/s",
    ]
    if report.goodput is not None:
        lines.append(f"goodput             {report.goodput:10.2f} req/s  ({_slo_text(slo)})")
    lines.append(f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, dist in (("TTFT", report.ttft_ms), ("TPOT", report.tpot_ms), ("E2E", report.e2e_ms)):
        lines.append(f"{name:<8}" + _dist_text(dist))
    return "\n".join(lines)


def _dist_text(dist: Distribution | None) -> str:
    if dist is None:
        return f"{'-':>10}" * 4
    return "".join(f"{v:10.1f}" for v in (dist.mean, dist.p50, dist.p90, dist.p99))


def _slo_text(slo: Slo) -> str:
    parts = []
    if slo.ttft_s is not None:
        parts.append(f"TTFT <= {slo.ttft_s * 1000:g} ms")
    if slo.tpot_s is not None:
        parts.append(f"TPOT <= {slo.tpot_s * 1000:g} ms")
    return ", ".join(parts)


def _print_errors(results: Sequence[RequestResult], limit: int = 5) -> None:
    errors = sorted({r.error for r in results if r.error is not None})
    for error in errors[:limit]:
        print(f"error: {error}", file=sys.stderr)
    if len(errors) > limit:
        print(f"... and {len(errors) - limit} other distinct errors", file=sys.stderr)


def _write_json(
    path: Path, report: Report, spec: LoadSpec, model: str, results: Sequence[RequestResult]
) -> None:
    start = min(r.timing.sent_at for r in results)
    doc = {
        "model": model,
        "spec": {**asdict(spec), "rate": spec.rate if math.isfinite(spec.rate) else "inf"},
        "report": asdict(report),
        "requests": [_request_json(r, start) for r in results],
    }
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))


def _request_json(result: RequestResult, start: float) -> dict[str, object]:
    t = result.timing
    return {
        "sent_s": t.sent_at - start,
        "prompt_tokens": len(result.request.prompt_token_ids),
        "max_tokens": result.request.max_tokens,
        "output_tokens": t.num_tokens,
        "ttft_s": t.ttft_s,
        "tpot_s": t.tpot_s,
        "e2e_s": t.e2e_s,
        "error": result.error,
    }


def _plot(path: Path, results: Sequence[RequestResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    done = [r.timing for r in results if r.ok]
    start = min(t.sent_at for t in done) if done else 0.0
    fig, (ttft_ax, tpot_ax, e2e_ax) = plt.subplots(1, 3, figsize=(15, 4))
    ttft_ax.hist([t.ttft_s * 1000 for t in done if t.ttft_s is not None], bins=30)
    ttft_ax.set(title="time to first token", xlabel="ms", ylabel="requests")
    tpot_ax.hist([t.tpot_s * 1000 for t in done if t.tpot_s is not None], bins=30)
    tpot_ax.set(title="time per output token", xlabel="ms", ylabel="requests")
    e2e_ax.scatter([t.sent_at - start for t in done], [t.e2e_s for t in done], s=6)
    e2e_ax.set(title="end-to-end latency by send time", xlabel="sent at (s)", ylabel="latency (s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
