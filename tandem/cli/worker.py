"""``tandem prefill-worker`` and ``tandem decode-worker``: one worker per process.

Each role takes only the flags it uses: both take the engine's, a prefill worker its KV
lease, a decode worker its KV pull timeout and speculative decoding. Engine flags left
out are not passed, so ``EngineConfig``'s defaults (stated in each flag's help) apply.
Argument parsing is torch-free; the worker's package is imported when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.cli.options import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    add_command,
    add_internal_tls_options,
    add_server_options,
    boolean,
    device,
    internal_tls,
    positive_int,
    quantization_group_size,
    require_redis,
    setup_logging,
    setup_tracing,
)
from tandem.common.lora import LoRARequest, lora_requests

if TYPE_CHECKING:
    from tandem.common.worker_host import WorkerOptions


@dataclass(frozen=True)
class EngineFlag:
    """A command-line flag for one ``EngineConfig`` field (``--max-num-seqs`` sets
    ``max_num_seqs``). Its default is the engine's, stated in ``help``."""

    flag: str
    type: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def field(self) -> str:
        return self.flag.replace("-", "_")


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("dtype", str, "compute dtype (default: auto, the checkpoint's)", DTYPES),
    EngineFlag("device", device, "auto, cpu, cuda or cuda:N (default: auto, CUDA if present)"),
    EngineFlag("block-size", positive_int, "tokens per KV block (default: 16; 256 with flash)"),
    EngineFlag(
        "num-kv-blocks",
        positive_int,
        "exact KV pool size in blocks (default: from --kv-cache-memory-gb)",
    ),
    EngineFlag(
        "kv-cache-memory-gb",
        float,
        "KV pool size, used whole (default: 4 GiB on CPU, 90%% of free memory on GPU, "
        "either capped at what --max-num-seqs full-length sequences need)",
    ),
    EngineFlag("max-num-seqs", positive_int, "most sequences batched per step (default: 128)"),
    EngineFlag(
        "max-num-batched-tokens",
        positive_int,
        "token budget per step (default: 1024 on CPU, 8192 on GPU)",
    ),
    EngineFlag(
        "max-model-len",
        positive_int,
        "longest prompt + output (default: the checkpoint's max_position_embeddings, or "
        "the most the KV pool holds when that is less and --num-kv-blocks is not given)",
    ),
    EngineFlag(
        "attention-backend",
        str,
        "attention implementation (default: the best available)",
        ATTENTION_BACKENDS,
    ),
    EngineFlag(
        "linear-backend",
        str,
        "matrix products: pre-packed oneDNN, Tandem's native AVX2 GEMM or plain torch "
        "(default: native where AVX2 is the best instruction set, else onednn where it works)",
        LINEAR_BACKENDS,
    ),
    EngineFlag(
        "quantization",
        str,
        "weight-only quantization at load: int8 per output channel, int4 per group of "
        "input channels (default: none, or what a `tandem quantize` checkpoint holds)",
        QUANTIZATIONS,
    ),
    EngineFlag(
        "kv-cache-dtype",
        str,
        "KV cache storage: auto (the model dtype) or 1-byte int8 / fp8 (e4m3; also spelled "
        "fp8_e4m3) values with a scale per token and head, ~4x the blocks per GiB "
        "(default: auto)",
        KV_CACHE_DTYPES,
    ),
    EngineFlag(
        "quantization-group-size",
        quantization_group_size,
        "input channels per int4 scale and zero point: 32, 64 or 128 (default: 64)",
    ),
    EngineFlag(
        "quantize-lm-head",
        boolean,
        "true: quantize the output projection too, with --quantization's method "
        "(default: False, it stays float)",
        metavar="{true,false}",
    ),
    EngineFlag(
        "num-threads",
        positive_int,
        "torch threads on CPU (default: torch's; `tandem serve` shares the cores)",
    ),
    EngineFlag("seed", int, "seed for requests that sample without one (default: 0)"),
    EngineFlag(
        "enable-prefix-caching",
        boolean,
        "reuse the KV of cached prompt prefixes; --no-enable-prefix-caching turns it off "
        "(default: True)",
        metavar="{true,false}",
    ),
    EngineFlag(
        "enable-chunked-prefill",
        boolean,
        "split long prompts over steps within --max-num-batched-tokens; "
        "--no-enable-chunked-prefill runs each prompt whole (default: True)",
        metavar="{true,false}",
    ),
    EngineFlag(
        "gpu-memory-utilization",
        float,
        "on GPU, the share of free memory the KV pool takes unless --kv-cache-memory-gb is "
        "given (default: 0.9)",
    ),
    EngineFlag(
        "tensor-parallel-size",
        positive_int,
        "ranks the model is split over; the worker starts ranks 1..N-1 itself, as local "
        "processes or, under Ray, as actors in its placement group (default: 1)",
    ),
    EngineFlag(
        "enable-expert-parallel",
        boolean,
        "mixture-of-experts models under tensor parallelism: each rank holds whole experts "
        "(num_experts / tensor-parallel-size of them) instead of a slice of every expert "
        "(default: False)",
        metavar="{true,false}",
    ),
    EngineFlag(
        "batch-invariant",
        boolean,
        "a sequence's logits do not depend on its batch, chunking or KV source: native CPU "
        "kernels with a fixed reduction order, in float32; a recomputed failover then "
        "continues bitwise (docs/reliability.md#batch-invariant-numerics; default: False)",
        metavar="{true,false}",
    ),
    EngineFlag(
        "enable-lora",
        boolean,
        "serve LoRA adapters (PEFT format; --lora-modules, /v1/load_lora_adapter) beside "
        "the base model (default: False)",
        metavar="{true,false}",
    ),
    EngineFlag("max-loras", positive_int, "distinct adapters one batch may mix (default: 1)"),
    EngineFlag("max-lora-rank", positive_int, "largest adapter rank accepted (default: 16)"),
    EngineFlag(
        "max-cpu-loras",
        positive_int,
        "adapters kept read in CPU memory (default: --max-loras)",
    ),
    EngineFlag(
        "lora-dtype",
        str,
        "adapter weights' dtype; bfloat16 halves what a step with many adapters reads "
        "(default: auto)",
        ("auto", "float32", "bfloat16", "float16"),
    ),
)
SPECULATIVE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(
        "speculative-method",
        str,
        "default proposer for speculative decoding; none: off (default: off, or draft "
        "with --draft-model)",
        (*SPECULATIVE_METHODS, "none"),
    ),
    EngineFlag(
        "num-speculative-tokens", positive_int, "most tokens proposed per step (default: 4)"
    ),
    EngineFlag(
        "draft-model", str, "draft checkpoint, same tokenizer (implies draft; default: none)"
    ),
    EngineFlag("ngram-max-n", positive_int, "longest n-gram prompt lookup matches (default: 4)"),
)
ROLE_ENGINE_FLAGS: dict[str, tuple[EngineFlag, ...]] = {
    "prefill": ENGINE_FLAGS,
    "decode": (*ENGINE_FLAGS, *SPECULATIVE_FLAGS),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    prefill = _add_worker(subparsers, "prefill")
    decode = _add_worker(subparsers, "decode")
    for worker, held in (
        (prefill, "a prefilled request's KV"),
        (decode, "a handed-over stream's KV"),
    ):
        worker.add_argument(
            "--lease-ttl",
            type=float,
            default=30.0,
            help=f"seconds {held} waits to be pulled before it is freed",
        )
        worker.add_argument(
            "--kv-store-port",
            type=int,
            default=0,
            help="TCP port of the torch.distributed store decode workers rendezvous at to "
            "pull KV from this one (0: a free port); plaintext, see "
            "docs/reliability.md#trust-boundary",
        )
    decode.add_argument(
        "--kv-pull-timeout",
        type=float,
        default=10.0,
        help="seconds a KV pull may take before the worker prefills the prompt itself",
    )
    decode.add_argument(
        "--drain-migrate-after",
        type=float,
        default=0.0,
        help="on SIGTERM, seconds streams may still run here before they are handed to "
        "another decode worker with their KV, when one is registered (without one, they "
        "run for --drain-timeout, then move) (default: 0, hand over at once)",
    )


def _add_worker(subparsers: argparse._SubParsersAction, role: str) -> argparse.ArgumentParser:
    worker = add_command(subparsers, f"{role}-worker", f"run one {role} worker")
    add_server_options(worker)
    worker.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    worker.add_argument("--worker-id", help="registry id (default: <role>-<random hex>)")
    worker.add_argument(
        "--advertise-host", help="host others use to reach this worker (default: --host)"
    )
    worker.add_argument(
        "--registry-ttl",
        type=float,
        default=3.0,
        help="seconds the registry keeps this worker after its last heartbeat",
    )
    worker.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=30.0,
        help="an engine loop that has not advanced for this long makes the worker not ready "
        "(health NOT_SERVING, out of the registry) until it moves again",
    )
    worker.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between registry heartbeats (each carries the worker's load)",
    )
    add_internal_tls_options(worker, router=False)
    add_lora_modules(worker)
    engine = worker.add_argument_group("engine")
    speculative = worker.add_argument_group("speculative decoding")
    for spec in ROLE_ENGINE_FLAGS[role]:
        group = speculative if spec in SPECULATIVE_FLAGS else engine
        switch = {"nargs": "?", "const": True} if spec.type is boolean else {}
        group.add_argument(
            f"--{spec.flag}",
            type=spec.type,
            choices=spec.choices,
            metavar=spec.metavar,
            help=spec.help,
            **switch,  # a bare --flag means true, as in vLLM
        )
        if spec.type is boolean:
            add_negation(group, spec.flag, spec.field)
    worker.set_defaults(run=run, role=role)
    return worker


def add_lora_modules(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--lora-modules``: adapters loaded at start-up."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to load at start (with --enable-lora): name=path, or vLLM's "
        'JSON form \'{"name": ..., "path": ..., "base_model_name": ...}\'; requests '
        "select one by its name as the model",
    )


def lora_modules(args: argparse.Namespace) -> tuple[LoRARequest, ...]:
    """The adapters ``--lora-modules`` names; a usage error without ``--enable-lora``."""
    try:
        requests = tuple(lora_requests(args.lora_modules))
    except ValueError as err:
        args.parser.error(str(err))
    if requests and not getattr(args, "enable_lora", None):
        args.parser.error("--lora-modules needs --enable-lora")
    return requests


def add_negation(group: argparse._ArgumentGroup, flag: str, dest: str) -> None:
    """vLLM's ``--no-FLAG`` for a switch: sets it false."""
    group.add_argument(
        f"--no-{flag}", dest=dest, action="store_const", const=False, help=f"--{flag} false"
    )


def engine_settings(args: argparse.Namespace) -> dict[str, object]:
    """The ``EngineConfig`` fields given on the command line (the rest keep defaults);
    ``--speculative-method none`` turns speculation off, a draft model included."""
    given = {
        f.field: getattr(args, f.field)
        for f in ROLE_ENGINE_FLAGS[args.role]
        if getattr(args, f.field) is not None
    }
    if "batch_invariant" not in given and os.environ.get("VLLM_BATCH_INVARIANT") == "1":
        given["batch_invariant"] = True  # vLLM's switch, for a drop-in command line
    if given.get("speculative_method") == "none":
        for field in ("speculative_method", "draft_model"):
            given.pop(field, None)
    return given


def check_speculation(args: argparse.Namespace) -> None:
    """Refuse, as a usage error, a draft proposer without a draft model."""
    if getattr(args, "speculative_method", None) == "draft" and not args.draft_model:
        args.parser.error("--speculative-method draft needs --draft-model DIR")


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """A worker's options from its parsed command line (``tandem prefill-worker`` /
    ``decode-worker``, or the same command line in a Ray actor): a usage error exits 2,
    a bad setting exits with its message."""
    from tandem.common.registry import WorkerRole
    from tandem.common.worker_host import WorkerOptions

    check_speculation(args)
    require_redis(args)
    try:
        tls = internal_tls(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    prefill = args.role == "prefill"
    role_options: dict[str, float] = {
        "lease_ttl_s": args.lease_ttl,
        "kv_store_port": args.kv_store_port,
    }
    if not prefill:
        role_options["kv_pull_timeout_s"] = args.kv_pull_timeout
        role_options["drain_migrate_after_s"] = args.drain_migrate_after
    return WorkerOptions(
        role=WorkerRole(args.role),
        model_dir=args.model,
        model_name=args.model_name[0] if args.model_name else Path(args.model).resolve().name,
        worker_id=args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}",
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        engine=engine_settings(args),
        registry_ttl_s=args.registry_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
        drain_timeout_s=args.drain_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        tls=tls,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        lora_modules=lora_modules(args),
        **role_options,
    )


def serve_worker(args: argparse.Namespace) -> Callable[..., Awaitable[None]]:
    """The coroutine function that serves this worker role (``run(options, stop=None)``)."""
    if args.role == "prefill":
        from tandem.prefill_worker.main import run as run_worker
    else:
        from tandem.decode_worker.main import run as run_worker
    return run_worker


def run(args: argparse.Namespace) -> int:
    options = worker_options(args)
    setup_logging(args.log_level)
    setup_tracing(args)
    asyncio.run(serve_worker(args)(options))
    return 0
