"""``tandem router``, ``tandem prefill-worker``, ``tandem decode-worker``: one component
per process, as a Kubernetes pod runs them. Argument parsing is torch-free; the
component's module is imported only when it runs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.common.registry import WorkerRole
    from tandem.router.routing.prefix_aware import PrefixCost

# EngineConfig fields a worker exposes as flags: (flag, type, help).
ENGINE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("dtype", str, "float32, bfloat16, float16 or auto (the checkpoint's)"),
    ("device", str, "cpu, cuda, cuda:N or auto"),
    ("block-size", int, "tokens per KV block (default 16; 256 with flash-attn)"),
    ("num-kv-blocks", int, "exact KV pool size in blocks"),
    ("kv-cache-memory-gb", float, "KV pool budget (default 4 GiB on CPU)"),
    ("max-num-seqs", int, "most sequences batched per step"),
    ("max-num-batched-tokens", int, "token budget per step"),
    ("max-model-len", int, "longest prompt + output"),
    ("attention-backend", str, "cpu, sdpa, torch or flash (default: best available)"),
    ("num-threads", int, "torch threads on CPU"),
    ("seed", int, "seed for unseeded random sampling"),
    ("speculative-method", str, "ngram or draft: speculative decoding's default proposer"),
    ("num-speculative-tokens", int, "most tokens proposed per step (default 4)"),
    ("draft-model", str, "draft checkpoint for speculative decoding (implies draft)"),
    ("ngram-max-n", int, "longest n-gram prompt lookup matches (default 4)"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser("router", help="run the gRPC router")
    _add_common(router)
    router.add_argument("--port", type=int, default=50051)
    router.add_argument("--prefill-policy", default="prefix_aware", choices=_policy_names())
    router.add_argument("--decode-policy", default="prefix_aware", choices=_policy_names())
    router.add_argument(
        "--routing-temperature",
        type=float,
        default=0.0,
        help="prefix_aware: soften the least-cost choice (0: always the cheapest)",
    )
    router.add_argument(
        "--imbalance-limit",
        type=float,
        default=1.25,
        help="prefix_aware: a worker loaded above this multiple of the pool mean (plus a "
        "slack) gets no credit for its cached prefix",
    )
    router.add_argument(
        "--metrics-port", type=int, help="serve Prometheus GET /metrics here (0: any port)"
    )
    router.add_argument(
        "--imbalance-slack",
        type=float,
        help="prefix_aware: the load a worker may carry above the limit before the guard "
        "applies (default: 256 queued prefill tokens; decode pool: 64)",
    )
    router.add_argument(
        "--imbalance-busy-limit",
        type=float,
        help="prefix_aware: the busy guard's multiple of the pool's mean busy share "
        "(default: the prefill pool's, see the README)",
    )
    router.add_argument(
        "--imbalance-busy-slack",
        type=float_or_off,
        help="prefix_aware: also void affinity for a worker whose recent busy share (from "
        "its heartbeats) exceeds the busy limit x the pool mean + this, for prefixes at least "
        "two workers hold; 'off' turns it off (default: 0 for the prefill pool, off for "
        "the decode pool)",
    )
    router.add_argument(
        "--idle-choices",
        type=int,
        help="prefix_aware: idle workers drawn per request for a tied choice, the least "
        "busy lately of them wins (default 4)",
    )
    router.add_argument(
        "--disaggregation-min-tokens",
        type=int,
        default=32,
        help="shorter prompts are prefilled by the decode worker itself",
    )
    router.add_argument("--max-pending-requests", type=int, default=1024)
    router.add_argument("--max-model-len", type=int)
    router.set_defaults(run=_run_router)
    for role in ("prefill", "decode"):
        worker = subparsers.add_parser(f"{role}-worker", help=f"run one {role} worker")
        _add_common(worker)
        worker.add_argument("--port", type=int, default=0, help="0 picks a free port")
        worker.add_argument("--worker-id", help="default: <role>-<random>")
        worker.add_argument("--advertise-host", help="host others use to reach this worker")
        worker.add_argument(
            "--lease-ttl",
            type=float,
            default=30.0,
            help="seconds a prefilled KV waits to be pulled",
        )
        worker.add_argument("--kv-pull-timeout", type=float, default=10.0)
        worker.add_argument(
            "--registry-ttl",
            type=float,
            default=3.0,
            help="seconds the registry keeps this worker after its last heartbeat",
        )
        worker.add_argument("--heartbeat-interval", type=float, default=1.0)
        for flag, kind, text in ENGINE_FLAGS:
            worker.add_argument(f"--{flag}", type=kind, help=text)
        worker.set_defaults(run=_run_worker, role=role)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HuggingFace checkpoint directory")
    parser.add_argument("--model-name", help="served model name (default: directory name)")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("TANDEM_REDIS_URL"),
        help="worker registry (default $TANDEM_REDIS_URL)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--log-level", default="INFO")


def _policy_names() -> list[str]:
    return ["round_robin", "least_loaded", "prefix_aware"]


def _model_name(args: argparse.Namespace) -> str:
    return args.model_name or Path(args.model).resolve().name


def _check_redis(args: argparse.Namespace) -> None:
    if not args.redis_url:
        raise SystemExit(
            "error: --redis-url is required (or run the whole cluster with `tandem serve`)"
        )


def float_or_off(text: str) -> float | str:
    """A number, or the word 'off' (a flag that turns a guard off)."""
    if text == "off":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def _prefix_cost(role: WorkerRole, args: argparse.Namespace) -> PrefixCost:
    """A pool's prefix-aware cost: its role's defaults with the flags given applied. The
    busy guard flags apply to the prefill pool only (a decode worker with any sequence
    steps all the time, so its busy share says little)."""
    from tandem.common.registry import WorkerRole
    from tandem.router.routing.prefix_aware import PrefixCost

    defaults = PrefixCost.default_for(role)
    slack = defaults.imbalance_slack if args.imbalance_slack is None else args.imbalance_slack
    cost = dataclasses.replace(
        defaults,
        temperature=args.routing_temperature,
        imbalance_limit=args.imbalance_limit,
        imbalance_slack=slack,
        idle_choices=defaults.idle_choices if args.idle_choices is None else args.idle_choices,
    )
    if role is not WorkerRole.PREFILL:
        return cost
    busy, busy_limit = args.imbalance_busy_slack, args.imbalance_busy_limit
    return dataclasses.replace(
        cost,
        busy_slack=cost.busy_slack if busy is None else None if busy == "off" else busy,
        busy_limit=cost.busy_limit if busy_limit is None else busy_limit,
    )


def _run_router(args: argparse.Namespace) -> int:
    from tandem.common.registry import WorkerRole
    from tandem.router.main import RouterOptions, run
    from tandem.router.routing.policy import PolicyName

    _check_redis(args)
    logging.basicConfig(level=args.log_level)
    try:
        prefill_cost, decode_cost = (
            _prefix_cost(role, args) for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    options = RouterOptions(
        model_dir=args.model,
        model_name=_model_name(args),
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        prefill_policy=PolicyName(args.prefill_policy),
        decode_policy=PolicyName(args.decode_policy),
        prefill_cost=prefill_cost,
        decode_cost=decode_cost,
        disaggregation_min_tokens=args.disaggregation_min_tokens,
        max_pending_requests=args.max_pending_requests,
        max_model_len=args.max_model_len,
        metrics_port=args.metrics_port,
    )
    asyncio.run(run(options))
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from tandem.common.registry import WorkerRole
    from tandem.common.worker_host import WorkerOptions

    _check_redis(args)
    logging.basicConfig(level=args.log_level)
    engine = {
        flag.replace("-", "_"): getattr(args, flag.replace("-", "_"))
        for flag, _, _ in ENGINE_FLAGS
        if getattr(args, flag.replace("-", "_")) is not None
    }
    options = WorkerOptions(
        role=WorkerRole(args.role),
        model_dir=args.model,
        model_name=_model_name(args),
        worker_id=args.worker_id or f"{args.role}-{uuid.uuid4().hex[:8]}",
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        engine=engine,
        lease_ttl_s=args.lease_ttl,
        kv_pull_timeout_s=args.kv_pull_timeout,
        registry_ttl_s=args.registry_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    if args.role == "prefill":
        from tandem.prefill_worker.main import run
    else:
        from tandem.decode_worker.main import run
    asyncio.run(run(options))
    return 0
