"""``tandem serve``: the whole cluster on this machine, until Ctrl-C.

With ``--demo`` it streams the answer to a sample request, then shuts down: the quick
start. Without ``--model`` it serves the default model, the trained target shipped in
``engine/assets/trained`` (``--speculative-method draft`` adds its trained draft).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tandem.cli.config_file import add_config_option
from tandem.cli.options import (
    LOG_LEVELS,
    SPECULATIVE_METHODS,
    add_command,
    add_tracing_option,
    positive_int,
    setup_logging,
)
from tandem.cli.planner import add_planner_options, planner_config
from tandem.cli.ray_flags import add_serve_options, ray_only_flags_given, ray_spec, uses_ray
from tandem.cli.router import (
    add_chat_options,
    add_lora_router_options,
    allow_runtime_lora_updating,
    tool_call_parser,
)

if TYPE_CHECKING:
    from tandem.cli.launcher import ClusterSpec, LocalCluster
    from tandem.ray.cluster import RayCluster

    Cluster = LocalCluster | RayCluster

DEMO_PROMPT = "def fibonacci(n):"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = add_command(
        subparsers,
        "serve",
        "run a whole cluster here: embedded Redis, prefill + decode workers, the router",
        __doc__.splitlines()[0],
    )
    serve.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="checkpoint directory, as in `vllm serve MODEL` (same as --model)",
    )
    serve.add_argument("--model", help="checkpoint directory (default: the built-in trained model)")
    serve.add_argument(
        "--model-name",
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="served model name (default: the directory's name; vLLM's --served-model-name); "
        "requests may also use any further names given",
    )
    serve.add_argument(
        "--prefill-workers", type=int, default=1, help="prefill worker processes (0: none)"
    )
    serve.add_argument("--decode-workers", type=positive_int, default=1, help="decode workers")
    serve.add_argument(
        "--port",
        "--http-port",
        type=int,
        help="the OpenAI-compatible HTTP API's port, as in `vllm serve` (default: 8000; "
        "with --demo, off unless given; 0: a free port, printed)",
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="the router's gRPC API port (tandem.v1.Generation; 0: a free port, printed)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics of the router on this port and of each worker on the next "
        "ones (prefill-0, prefill-1, ..., decode-0, ...); default 0: free ports, printed",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    serve.add_argument(
        "--generation-config",
        metavar="{auto,vllm,DIR}",
        help="the router's sampling defaults for what a request leaves unset (default: "
        "auto, the checkpoint's generation_config.json; vllm: Tandem's own; see tandem "
        "router --help)",
    )
    serve.add_argument(
        "--redis-url",
        default=os.environ.get("TANDEM_REDIS_URL"),
        help="an existing Redis; a password stays off the command line in $TANDEM_REDIS_URL "
        "(default: $TANDEM_REDIS_URL, else start an embedded one)",
    )
    serve.add_argument("--log-dir", type=Path, help="one log file per process (default: echo)")
    serve.add_argument("--demo", action="store_true", help="answer a sample request, then stop")
    security = serve.add_argument_group("security")
    security.add_argument(
        "--tls-dir",
        type=Path,
        help="TLS on the router's port and mutual TLS between every component, with the "
        "certificates of `tandem certs DIR` (made there if DIR has no ca.pem; default: off)",
    )
    security.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key the router requires (repeatable; also $TANDEM_API_KEYS, comma-separated)",
    )
    serve.add_argument(
        "--planner",
        action="store_true",
        help="run the SLO planner on this cluster: it adds and drains workers per pool "
        "against --ttft-p99 / --tpot-p99 (see the planner flags)",
    )
    add_planner_options(serve)
    add_serve_options(serve)
    serve.add_argument(
        "--log-level",
        default="WARNING",
        choices=LOG_LEVELS,
        help="every component's logging threshold: quiet by default (warnings and errors "
        "only, beside the start-up lines and the answer); INFO shows each component's "
        "events, DEBUG also tracebacks; --log-dir keeps them in files",
    )
    extra = serve.add_argument_group(
        "pass-through flags", "Repeatable; each value is one flag of the component's command."
    )
    extra.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for every worker, e.g. --worker-arg=--max-num-seqs=64",
    )
    extra.add_argument(
        "--prefill-worker-arg",
        action="append",
        default=[],
        help="extra flag for prefill workers (see tandem prefill-worker --help)",
    )
    extra.add_argument(
        "--decode-worker-arg",
        action="append",
        default=[],
        help="extra flag for decode workers (see tandem decode-worker --help)",
    )
    extra.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra flag for the router (see tandem router --help)",
    )
    spec = serve.add_argument_group(
        "speculative decoding (decode workers)",
        "Off unless asked for; with the default model, --speculative-method draft uses "
        "its trained draft.",
    )
    spec.add_argument(
        "--speculative-method",
        choices=(*SPECULATIVE_METHODS, "none"),
        help="proposer for the decode workers (none: off, even with --draft-model)",
    )
    spec.add_argument(
        "--num-speculative-tokens", type=positive_int, help="most drafts per step (k)"
    )
    spec.add_argument("--draft-model", help="draft checkpoint (implies --speculative-method draft)")
    spec.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="vLLM's one-flag form instead of the three above: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' or '
        '\'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\'',
    )
    add_chat_options(serve)
    add_lora_router_options(serve, router=False)
    from tandem.cli.worker import add_lora_modules

    add_lora_modules(serve)
    add_tracing_option(serve.add_argument_group("tracing (every component)"))
    add_config_option(serve)
    _add_engine_flags(serve)
    serve.set_defaults(run=_run)


VLLM_REFUSED = {
    "swap-space": "Tandem keeps no CPU swap space for KV: a preempted sequence is recomputed",
    "trust-remote-code": "Tandem runs no code from checkpoints: its architectures are built in",
}
"""vLLM flags ``tandem serve`` refuses by name (with why) rather than as unknown."""


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """Every worker's engine flag, under vLLM's names, on ``tandem serve`` too: each one
    given is passed to every worker (before ``--worker-arg``, which can still override
    it). Flags ``serve`` has already (``--tensor-parallel-size``, ...) keep their own."""
    from tandem.cli.worker import ENGINE_FLAGS, add_negation, boolean

    taken = {action.dest for action in serve._actions}
    group = serve.add_argument_group(
        "engine (vLLM's flag names; passed to every worker)",
        "Each flag given here goes to every prefill and decode worker, as --worker-arg "
        "would pass it.",
    )
    for flag in ENGINE_FLAGS:
        if flag.field in taken:
            continue
        switch = {"nargs": "?", "const": True} if flag.type is boolean else {}
        group.add_argument(
            f"--{flag.flag}",
            dest=f"engine_{flag.field}",
            type=flag.type,
            choices=flag.choices,
            metavar=flag.metavar or (None if flag.choices else flag.field.upper()),
            help=flag.help,
            **switch,
        )
        if flag.type is boolean:
            add_negation(group, flag.flag, f"engine_{flag.field}")
    for name, why in VLLM_REFUSED.items():
        group.add_argument(
            f"--{name}",
            dest=f"refused_{name.replace('-', '_')}",
            nargs="?",
            const=True,
            metavar="VALUE",
            help=f"refused: {why}",
        )


def _model_argument(args: argparse.Namespace) -> str | None:
    """The model given positionally or by ``--model`` (not both); a refused vLLM flag is
    a usage error first."""
    for name, why in VLLM_REFUSED.items():
        if getattr(args, f"refused_{name.replace('-', '_')}", None) is not None:
            args.parser.error(f"--{name}: {why}")
    if args.model_path and args.model and args.model_path != args.model:
        args.parser.error(f"two models: {args.model_path} and --model {args.model}")
    return args.model or args.model_path


def engine_flag_args(args: argparse.Namespace) -> list[str]:
    """The worker arguments of the engine flags given to ``serve``."""
    from tandem.cli.worker import ENGINE_FLAGS

    out = []
    for flag in ENGINE_FLAGS:
        value = getattr(args, f"engine_{flag.field}", None)
        if value is not None:
            out.append(f"--{flag.flag}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def _run(args: argparse.Namespace) -> int:
    from tandem.cli.launcher import ClusterSpec
    from tandem.common.redis_server import redacted_url

    if args.model and args.speculative_method == "draft" and not args.draft_model:
        args.parser.error("--speculative-method draft needs --draft-model DIR with --model")
    on_ray = uses_ray(args)
    if not on_ray and (ray_only := ray_only_flags_given(args)):
        args.parser.error(f"{', '.join(ray_only)}: Ray settings, give --ray too")
    if on_ray and args.log_dir is not None:
        args.parser.error("--log-dir: on Ray each component logs to Ray's log folder (`ray logs`)")
    if on_ray:
        from tandem.ray import require_ray

        require_ray("tandem serve --ray")
    args.model = _model_argument(args)
    spec_extra = _speculative_config(args)
    http_port = _http_port(args)
    model = args.model or str(default_model())
    generation_config = args.generation_config
    spec = ClusterSpec(
        model_dir=model,
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        router_port=args.grpc_port,
        host=args.host,
        redis_url=args.redis_url,
        model_name=args.model_name[0] if args.model_name else None,
        worker_args=(
            *_replica_args(args),
            *engine_flag_args(args),
            *_tracing_args(args),
            *(("--lora-modules", *args.lora_modules) if args.lora_modules else ()),
            *args.worker_arg,
        ),
        prefill_args=tuple(args.prefill_worker_arg),
        decode_args=(*spec_extra, *_speculative_args(args), *args.decode_worker_arg),
        router_args=(
            *(() if http_port is None else ("--http-port", str(http_port))),
            *(() if generation_config is None else ("--generation-config", generation_config)),
            *_chat_args(args),
            *(("--allow-runtime-lora-updating",) if allow_runtime_lora_updating(args) else ()),
            *_tracing_args(args),
            *(("--model-name", *args.model_name) if args.model_name else ()),
            *args.router_arg,
        ),
        log_dir=args.log_dir,
        log_level=args.log_level,
        restart=not args.demo,
        tls_dir=args.tls_dir,
        api_keys=_api_keys(args),
        metrics_port=args.metrics_port,
    )
    try:
        check_flags(spec)
        placement = ray_spec(args) if on_ray else None
    except ValueError as err:  # a usage error: nothing was started
        print(f"tandem serve: error: {err}", file=sys.stderr)
        return 2
    planning = planner_config(args) if args.planner else None  # bad bounds: exit 2 now
    cluster = _cluster(spec, placement)
    tp = f" (tensor-parallel size {args.tensor_parallel_size})" * (args.tensor_parallel_size > 1)
    where = f" on Ray ({args.ray_address or 'a local Ray'})" if on_ray else ""
    print(
        f"starting {spec.num_prefill} prefill + {spec.num_decode} decode replicas{tp} for "
        f"{model}{where}",
        flush=True,
    )
    with cluster:
        embedded = " (embedded)" if spec.redis_url is None else ""
        print(
            f"tandem serving {cluster.model_name!r} at {cluster.router_address}; registry "
            f"{redacted_url(cluster.redis_url)}{embedded}"
        )
        if on_ray:
            # A local Ray started by ray.init uses token authentication; Ray's CLI needs
            # to be told so.
            auth = "RAY_AUTH_MODE=token " if cluster.started_ray else ""
            print(
                f"Ray: {cluster.ray_address}, namespace {args.ray_namespace!r} "
                f"(`{auth}ray list actors`; `tandem scale --role decode --replicas N`)"
            )
        if http_port is not None:
            scheme = "https" if cluster.certs is not None else "http"
            print(f"OpenAI-compatible API at {scheme}://{cluster.http_address}/v1")
        metrics = ", ".join(f"{name} {url}" for name, url in cluster.metrics_urls.items())
        print(f"Prometheus metrics: {metrics}")
        if cluster.certs is not None:
            print(f"TLS on; clients trust {cluster.certs.ca} (tandem generate --ssl-ca-certs)")
        sys.stdout.flush()
        if args.demo:
            _demo(cluster)
            _print_speculation(cluster)
            return 0
        if planning is not None:
            setup_logging(args.log_level)  # the planner logs each change with its inputs
            with _planner(cluster, planning, args.planner_interval):
                wait_for_signal()
        else:
            wait_for_signal()
        print("stopping", flush=True)
    return 0


VLLM_HTTP_PORT = 8000


def _http_port(args: argparse.Namespace) -> int | None:
    """The OpenAI API's port: ``--port`` as in vLLM (8000 by default), off for ``--demo``
    unless given (the demo asks over gRPC, and a busy 8000 must not stop it)."""
    port = args.port if args.port is not None else None if args.demo else VLLM_HTTP_PORT
    if port is not None and port != 0 and port == args.grpc_port:
        args.parser.error(
            f"--port {port} is the OpenAI HTTP API's port (as in vllm serve) and "
            f"--grpc-port is {args.grpc_port}: give them different ports"
        )
    return port


def _tracing_args(args: argparse.Namespace) -> list[str]:
    endpoint = args.otlp_traces_endpoint
    return [] if endpoint is None else [f"--otlp-traces-endpoint={endpoint}"]


def _chat_args(args: argparse.Namespace) -> list[str]:
    """The router's chat template and tool-calling flags, as given to ``serve``."""
    out = []
    if args.chat_template is not None:
        # A file is passed by its absolute path: the router may run in another folder.
        path = Path(args.chat_template).expanduser()
        out.append(f"--chat-template={path.resolve() if path.is_file() else args.chat_template}")
    if tool_call_parser(args) is not None:
        out.append("--enable-auto-tool-choice")
        out.append(f"--tool-call-parser={args.tool_call_parser}")
    return out


def _cluster(spec: ClusterSpec, placement) -> Cluster:
    """A ``LocalCluster`` (processes), or a ``RayCluster`` for a ``RaySpec``."""
    if placement is None:
        from tandem.cli.launcher import LocalCluster

        return LocalCluster(spec)
    from tandem.ray.cluster import RayCluster

    return RayCluster(spec, placement)


def _replica_args(args: argparse.Namespace) -> list[str]:
    """Worker flags from the replica-shape flags (tensor parallelism, KV pool)."""
    out = []
    if args.tensor_parallel_size > 1:
        out += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.kv_cache_memory_gb is not None:
        out += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    return out


@contextlib.contextmanager
def _planner(cluster: Cluster, config, interval_s: float) -> Iterator[None]:
    """The SLO planner on its own thread, scaling ``cluster``'s pools."""
    from tandem.planner.actuators import ClusterActuator
    from tandem.planner.loop import Planner

    endpoints = cluster.planner_endpoints
    planner = Planner(config, ClusterActuator(cluster), endpoints, cluster.model_name)
    stop = threading.Event()
    thread = threading.Thread(target=planner.run, args=(interval_s, stop), name="planner")
    thread.start()
    print(
        f"planner on: TTFT p99 <= {config.ttft_p99_s:g} s, TPOT p99 <= {config.tpot_p99_s:g} s, "
        f"prefill {config.prefill.min_replicas}-{config.prefill.max_replicas}, "
        f"decode {config.decode.min_replicas}-{config.decode.max_replicas}",
        flush=True,
    )
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def check_flags(spec: ClusterSpec) -> None:
    """Parse every component's flags as it will, and check the router's and each worker
    role's settings against the checkpoint, before anything starts: a bad flag exits 2
    with that component's usage, a setting or checkpoint file that cannot work raises
    ``ValueError`` naming it."""
    from tandem.cli.main import parse
    from tandem.cli.worker import check_speculation, engine_settings, lora_modules
    from tandem.common.lora import adapter_weights_file, read_adapter_config
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import check_config
    from tandem.router.validation import RequestValidator

    common = ("--model", spec.model_dir, "--redis-url", "redis://unused")
    router = parse(["router", *common, *spec.router_args])
    try:  # the checkpoint's config, tokenizer and generation config, as the router reads them
        tool_call_parser(router)
        RequestValidator.from_dir(
            spec.model_dir,
            "check",
            router.max_model_len,
            router.generation_config,
            chat_template=router.chat_template,
        )
    except ValueError as err:
        raise ValueError(f"router: {err}") from None
    roles = {"prefill": spec.prefill_args, "decode": spec.decode_args}
    for role, role_args in roles.items():
        if role == "prefill" and not spec.num_prefill:
            continue
        args = parse([f"{role}-worker", *common, *spec.worker_args, *role_args])
        check_speculation(args)
        try:
            check_config(EngineConfig(model=spec.model_dir, **engine_settings(args)))
            for lora in lora_modules(args):  # the files, before any worker reads them
                read_adapter_config(lora.lora_path, lora.lora_name)
                adapter_weights_file(lora.lora_path, lora.lora_name)
        except ValueError as err:
            raise ValueError(f"{role} workers: {err}") from None


SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max")


def _speculative_config(args: argparse.Namespace) -> list[str]:
    """vLLM's ``--speculative-config`` JSON set as ``--speculative-method``,
    ``--num-speculative-tokens`` and ``--draft-model``; returns the decode-worker flags
    it adds beyond those (``prompt_lookup_max``: ``--ngram-max-n``). A usage error for
    what Tandem does not do, named."""
    text = args.speculative_config
    if text is None:
        return []

    def error(why: str) -> NoReturn:
        args.parser.error(f"--speculative-config: {why}")

    if any(v is not None for v in (args.speculative_method, args.num_speculative_tokens)) or (
        args.draft_model is not None
    ):
        error("give it or --speculative-method / --num-speculative-tokens / --draft-model")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        error(f"not JSON: {err}")
    if not isinstance(config, dict):
        error("must be a JSON object")
    for key in config:
        if key not in SPECULATIVE_CONFIG_KEYS:
            error(f"{key!r} is not supported (Tandem takes {', '.join(SPECULATIVE_CONFIG_KEYS)})")
    method, draft = config.get("method"), config.get("model")
    if method == "ngram" and draft is None:
        args.speculative_method = "ngram"
    elif method in (None, "draft_model", "draft") and isinstance(draft, str):
        args.speculative_method, args.draft_model = "draft", draft
    else:
        error(
            f"method {method!r}{' with a model' if draft else ''}: Tandem proposes with "
            "n-grams (method ngram) or a draft model (model DIR)"
        )
    extra = []
    for key in ("num_speculative_tokens", "prompt_lookup_max"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            error(f"{key} must be a positive integer, got {value!r}")
        if key == "num_speculative_tokens":
            args.num_speculative_tokens = value
        else:
            extra.append(f"--ngram-max-n={value}")
    return extra


def _speculative_args(args: argparse.Namespace) -> list[str]:
    """Decode-worker flags for speculative decoding; the default model brings its draft.

    Off by default: on CPU-sized models a draft's step is mostly fixed overhead, and
    speculating is slower at batch 1 (docs/benchmarks/specdec.md)."""
    method, draft = args.speculative_method, args.draft_model
    if method == "none":
        return []
    if draft is None and args.model is None and method == "draft":
        draft = str(default_model().parent / "draft")
    out = []
    if method is not None:
        out += ["--speculative-method", method]
    if draft is not None and method != "ngram":
        out += ["--draft-model", draft]
    if args.num_speculative_tokens is not None:
        out += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    return out


def default_model() -> Path:
    """The trained target shipped with ``tandem.engine`` (``engine/assets/trained/target``;
    its README says how it was made). Raises ``FileNotFoundError`` when it is missing."""
    import importlib.util

    engine = importlib.util.find_spec("tandem.engine")  # locates the package, imports no torch
    path = Path(engine.origin).parent / "assets" / "trained" / "target"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the default model is missing from {path}; pass --model DIR")
    return path


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    from_env = [k.strip() for k in os.environ.get("TANDEM_API_KEYS", "").split(",")]
    return tuple(dict.fromkeys(k for k in [*args.api_key, *from_env] if k))


def _demo(cluster: Cluster) -> None:
    from tandem.common.client import stream_generate
    from tandem.protos import common_pb2

    print(f"\n>>> {DEMO_PROMPT}")
    sampling = common_pb2.SamplingParams(max_tokens=48, temperature=0)
    responses = stream_generate(
        cluster.router_address,
        DEMO_PROMPT,
        sampling,
        timeout_s=120,
        api_key=cluster.api_key,
        root_certificates=cluster.ca_certificates,
    )
    for response in responses:
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if response.HasField("usage"):
            u = response.usage
            print(
                f"\n\n[{u.prompt_tokens} prompt tokens, {u.completion_tokens} generated, "
                f"{u.cached_prompt_tokens} from the prefix cache]"
            )


def _print_speculation(cluster: Cluster) -> None:
    """What the decode workers' speculative decoding did (from their ``GetStatus``)."""
    from tandem.protos import worker_pb2, worker_pb2_grpc

    for name in cluster.workers("decode"):
        with cluster.worker_channel(name) as channel:
            status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(
                worker_pb2.StatusRequest(), timeout=10
            )
        if not status.HasField("spec_decode"):
            continue
        spec = status.spec_decode
        if spec.num_draft_tokens and spec.num_request_passes:
            print(
                f"[{name} speculated: {spec.num_accepted_tokens} of "
                f"{spec.num_draft_tokens} drafted tokens accepted, "
                f"{spec.num_pass_tokens / spec.num_request_passes:.2f} tokens per target "
                "forward]"
            )


def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
