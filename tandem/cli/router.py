"""``tandem router``: the gRPC front door, one process (as a Kubernetes pod runs it).

Argument parsing is torch-free; ``tandem.router`` is imported only when the command
runs. The prefix-aware flags set both pools' costs over their role's defaults
(``PrefixCost.default_for``); the busy-guard flags apply to the prefill pool only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.cli.options import (
    add_command,
    add_internal_tls_options,
    add_server_options,
    float_or_off,
    internal_tls,
    positive_int,
    require_redis,
    setup_logging,
    setup_tracing,
)

if TYPE_CHECKING:
    from tandem.common.registry import WorkerRole
    from tandem.common.tls import TLSFiles
    from tandem.router.main import RouterOptions
    from tandem.router.rate_limit import RateLimit
    from tandem.router.routing.prefix_aware import PrefixCost

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    router = add_command(subparsers, "router", "run the gRPC router")
    add_server_options(router)
    router.add_argument("--port", type=int, default=50051, help="gRPC port of the public API")
    router.add_argument(
        "--disaggregation-min-tokens",
        type=int,
        default=32,
        help="shorter prompts are prefilled by the decode worker itself",
    )
    router.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=512,
        help="conditional disaggregation: a prompt of which a decode worker holds more than "
        "any prefill worker (a conversation's earlier turns, answers included) is prefilled "
        "on that decode worker when at most this many tokens are left to compute (0: off)",
    )
    router.add_argument(
        "--max-pending-requests",
        type=positive_int,
        default=1024,
        help="requests admitted at once; more get RESOURCE_EXHAUSTED",
    )
    router.add_argument(
        "--max-model-len",
        type=positive_int,
        help="longest prompt + output accepted (default: the checkpoint's context); the "
        "smallest max_model_len the live workers report lowers it",
    )
    router.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="sampling defaults for what a request leaves unset: auto (the default) takes "
        "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens from the "
        "checkpoint's generation_config.json, as vLLM does; vllm ignores the file "
        "(temperature 1, 16 tokens, ...); DIR reads DIR/generation_config.json",
    )
    router.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="a decode stream silent for max(this, 20 x its mean time per token), or 3x "
        "this before its first token, moves to another decode worker",
    )
    rebalance = router.add_argument_group(
        "rebalancing",
        "Move running streams, with their KV, off a decode worker whose KV pool or batch is "
        "fuller than its peers' (live migration; docs/routing.md#rebalancing).",
    )
    rebalance.add_argument(
        "--rebalance-interval",
        type=float,
        default=0.0,
        help="seconds between comparisons of the decode workers' KV and batch usage "
        "(default: 0, off)",
    )
    rebalance.add_argument(
        "--rebalance-gap",
        type=float,
        default=0.25,
        help="usage difference, fullest minus emptiest, that moves streams (default: 0.25)",
    )
    rebalance.add_argument(
        "--rebalance-min-usage",
        type=float,
        default=0.5,
        help="the fullest worker's usage must also reach this (default: 0.5)",
    )
    rebalance.add_argument(
        "--rebalance-cooldown",
        type=float,
        default=10.0,
        help="seconds before a worker that gave or took streams gives again (default: 10)",
    )
    keys = router.add_argument_group(
        "API keys",
        "With any key given, calls to tandem.v1.Generation need metadata "
        "'authorization: Bearer <key>' (health and reflection stay open). Prefer a file or "
        "the environment: a flag's value shows in the process list.",
    )
    keys.add_argument("--api-key", action="append", default=[], help="a key (repeatable)")
    keys.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        type=Path,
        help="a file of keys, one a line, # comments (repeatable; also $TANDEM_API_KEYS, "
        "comma-separated)",
    )
    keys.add_argument(
        "--rate-limit",
        type=float,
        help="Generate calls per second per API key, shared by every router on the same "
        "Redis; over it: RESOURCE_EXHAUSTED with a retry hint (default: none)",
    )
    keys.add_argument(
        "--rate-limit-burst",
        type=positive_int,
        help="calls a key may make at once (default: the rate, at least 1)",
    )
    tls = router.add_argument_group("TLS on the public port (both files, or neither)")
    tls.add_argument("--ssl-certfile", type=Path, help="PEM certificate chain (default: off)")
    tls.add_argument("--ssl-keyfile", type=Path, help="PEM private key (default: off)")
    add_internal_tls_options(router, router=True)
    router.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models) on this port, with the same keys and TLS "
        "(default: off)",
    )
    ready = router.add_argument_group(
        "readiness",
        "gRPC health (service '') is NOT_SERVING while fewer workers than these are "
        "registered; liveness (service 'tandem.liveness') is SERVING while the process runs.",
    )
    ready.add_argument(
        "--min-decode-workers", type=positive_int, default=1, help="decode workers needed"
    )
    ready.add_argument(
        "--min-prefill-workers",
        type=int,
        default=0,
        help="prefill workers needed (0: decode workers prefill when none is left)",
    )
    add_chat_options(router)
    add_lora_router_options(router)
    _add_routing_options(router)
    router.set_defaults(run=run)


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")
"""``--tool-call-parser`` choices (``tandem.router.openai_api.tools.PARSERS``' names,
kept here so parsing the command line imports no router code)."""


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """The chat template and tool-calling flags, under vLLM's names (router and serve)."""
    chat = parser.add_argument_group("chat and tool calling (vLLM's flags)")
    chat.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a jinja chat template replacing the checkpoint's: a file, or the template text",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default with '
        "tools); needs --tool-call-parser",
    )
    chat.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how calls are read from the output under auto: hermes (<tool_call> JSON "
        "blocks: Hermes, Qwen 2.5/3, Tandem's checkpoints), llama3_json (Llama 3.1+) or "
        "pythonic ([f(a=1), g()]: Llama 3.2 / 4)",
    )


def add_lora_router_options(parser: argparse.ArgumentParser, router: bool = True) -> None:
    """The router's LoRA flags (``router=False``: only those ``serve`` passes on)."""
    from tandem.router.routing.adapters import DEFAULT_COLD_LOAD_TOKENS

    if router:
        parser.add_argument(
            "--lora-cold-load-tokens",
            type=int,
            default=DEFAULT_COLD_LOAD_TOKENS,
            help="what reading a LoRA adapter from disk costs, in queued prompt tokens: a "
            "request goes to a worker with its adapter in memory unless that worker's queue "
            f"is longer than the least by more (default: {DEFAULT_COLD_LOAD_TOKENS})",
        )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load or "
        "drop a LoRA adapter on every worker (also on with vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )


def allow_runtime_lora_updating(args: argparse.Namespace) -> bool:
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
    return bool(args.allow_runtime_lora_updating) or env in ("1", "true")


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser auto tool choice uses (``None``: off); a usage error when only one
    of the two flags is given."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        args.parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        args.parser.error("--tool-call-parser needs --enable-auto-tool-choice")
    return args.tool_call_parser


def _add_routing_options(router: argparse.ArgumentParser) -> None:
    g = router.add_argument_group("routing", "The prefix_aware flags: see docs/routing.md.")
    g.add_argument(
        "--prefill-policy", default="prefix_aware", choices=POLICIES, help="prefill pool"
    )
    g.add_argument("--decode-policy", default="prefix_aware", choices=POLICIES, help="decode pool")
    g.add_argument(
        "--routing-temperature",
        type=float,
        default=0.0,
        help="prefix_aware: soften the least-cost choice (0: always the cheapest)",
    )
    g.add_argument(
        "--imbalance-limit",
        type=float,
        default=1.25,
        help="prefix_aware: a worker loaded above this multiple of the pool mean (plus a "
        "slack) gets no credit for its cached prefix",
    )
    g.add_argument(
        "--imbalance-slack",
        type=float,
        help="prefix_aware: the load a worker may carry above the limit before the guard "
        "applies (default: 256 queued prefill tokens; decode pool: 64)",
    )
    g.add_argument(
        "--imbalance-busy-limit",
        type=float,
        help="prefix_aware: the busy guard's multiple of the pool's mean busy share (default: 1.1)",
    )
    g.add_argument(
        "--imbalance-busy-slack",
        type=float_or_off,
        help="prefix_aware: also void affinity for a worker whose recent busy share (from "
        "its heartbeats) exceeds the busy limit x the pool mean + this, for prefixes at least "
        "two workers hold; 'off' turns it off (default: 0 for the prefill pool, off for "
        "the decode pool)",
    )
    g.add_argument(
        "--idle-choices",
        type=positive_int,
        help="prefix_aware: idle workers drawn per request for a tied choice, the least "
        "busy lately of them wins (default: 4)",
    )


def prefix_cost(role: WorkerRole, args: argparse.Namespace) -> PrefixCost:
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


def _rate_limit(args: argparse.Namespace) -> RateLimit | None:
    from tandem.router.rate_limit import RateLimit

    if args.rate_limit is None:
        if args.rate_limit_burst is not None:
            args.parser.error("--rate-limit-burst needs --rate-limit")
        return None
    burst = args.rate_limit_burst or max(1, math.ceil(args.rate_limit))
    return RateLimit(args.rate_limit, burst)


def _tls(args: argparse.Namespace) -> TLSFiles | None:
    from tandem.common.tls import TLSFiles

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        args.parser.error("--ssl-certfile and --ssl-keyfile go together")
    return None if args.ssl_certfile is None else TLSFiles(args.ssl_certfile, args.ssl_keyfile)


def run(args: argparse.Namespace) -> int:
    from tandem.router.main import run

    setup_logging(args.log_level)
    options = router_options(args)
    setup_tracing(args)
    asyncio.run(run(options))
    return 0


def router_options(args: argparse.Namespace) -> RouterOptions:
    """The router's options from its parsed command line; a usage error exits 2, a bad
    setting exits with its message."""
    from tandem.common.registry import WorkerRole
    from tandem.router.auth import ENV_VAR as KEYS_ENV
    from tandem.router.auth import ApiKeys
    from tandem.router.main import RouterOptions
    from tandem.router.readiness import ReadinessRule
    from tandem.router.rebalance import RebalanceConfig
    from tandem.router.routing.policy import PolicyName
    from tandem.router.stall import StallPolicy

    require_redis(args)
    try:
        prefill_cost, decode_cost = (
            prefix_cost(role, args) for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
        )
        readiness = ReadinessRule(args.min_decode_workers, args.min_prefill_workers)
        stall = StallPolicy(floor_s=args.stall_timeout)
        api_keys = ApiKeys.gather(args.api_key, args.api_key_file, os.environ.get(KEYS_ENV))
        tls = _tls(args)
        mtls = internal_tls(args)
        rate_limit = _rate_limit(args)
        rebalance = RebalanceConfig(
            args.rebalance_interval,
            args.rebalance_gap,
            args.rebalance_min_usage,
            args.rebalance_cooldown,
        )
        if rate_limit is not None and api_keys is None:
            args.parser.error("--rate-limit is per API key: give keys too (--api-key-file ...)")
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    return RouterOptions(
        model_dir=args.model,
        model_name=args.model_name[0] if args.model_name else Path(args.model).resolve().name,
        model_aliases=tuple(args.model_name[1:]) if args.model_name else (),
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        prefill_policy=PolicyName(args.prefill_policy),
        decode_policy=PolicyName(args.decode_policy),
        prefill_cost=prefill_cost,
        decode_cost=decode_cost,
        disaggregation_min_tokens=args.disaggregation_min_tokens,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        max_pending_requests=args.max_pending_requests,
        max_model_len=args.max_model_len,
        generation_config=args.generation_config,
        metrics_port=args.metrics_port,
        readiness=readiness,
        stall=stall,
        api_keys=api_keys,
        tls=tls,
        internal_tls=mtls,
        health_port=args.health_port,
        http_port=args.http_port,
        rate_limit=rate_limit,
        drain_timeout_s=args.drain_timeout,
        chat_template=args.chat_template,
        tool_call_parser=tool_call_parser(args),
        rebalance=rebalance,
        allow_runtime_lora_updating=allow_runtime_lora_updating(args),
        lora_cold_load_tokens=args.lora_cold_load_tokens,
    )
