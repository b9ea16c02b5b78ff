"""Run the router process (``tandem router``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.common.grpc_server import start_server
from tandem.common.metrics import MetricsServer
from tandem.common.process import SHUTDOWN_GRACE_S, arm_exit_watchdog, stop_on_signals
from tandem.common.registry import RegistryWatcher, WorkerRecord, WorkerRole
from tandem.common.tls import InternalTLS, TLSFiles
from tandem.common.tokenizer import Tokenizer
from tandem.protos import generation_pb2, generation_pb2_grpc
from tandem.router.auth import ApiKeyInterceptor, ApiKeys
from tandem.router.clients import WorkerClients
from tandem.router.kv_index.consumer import KVEventConsumer, grpc_snapshot_fetcher
from tandem.router.kv_index.indexer import KVIndexer
from tandem.router.lora_admin import LoRAFleet
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator, OrchestratorConfig
from tandem.router.rate_limit import RateLimit, RateLimiter
from tandem.router.readiness import ReadinessRule, ReadinessTracker
from tandem.router.rebalance import RebalanceConfig, Rebalancer
from tandem.router.routing.adapters import DEFAULT_COLD_LOAD_TOKENS
from tandem.router.routing.inflight import InflightLoad
from tandem.router.routing.policy import PolicyName, make_policy
from tandem.router.routing.prefix_aware import PrefixCost
from tandem.router.service import GenerationService, Generator
from tandem.router.stall import StallPolicy
from tandem.router.validation import RequestValidator

if TYPE_CHECKING:
    from tandem.router.openai_api.server import HttpServer

log = logging.getLogger(__name__)

HTTP_PREFIX = "HTTP "
"""The router's ``HTTP <port>`` line: where its OpenAI API listens (before READY)."""


@dataclass(frozen=True)
class RouterOptions:
    model_dir: str
    model_name: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 50051
    prefill_policy: PolicyName = PolicyName.PREFIX_AWARE
    decode_policy: PolicyName = PolicyName.PREFIX_AWARE
    prefill_cost: PrefixCost | None = None
    """Prefix-aware weights for the prefill pool (``None``: the defaults)."""
    decode_cost: PrefixCost | None = None
    disaggregation_min_tokens: int = 32
    max_local_prefill_tokens: int = 512
    """Conditional disaggregation (``OrchestratorConfig.max_local_prefill_tokens``)."""
    max_pending_requests: int = 1024
    max_model_len: int | None = None
    generation_config: str = "auto"
    """Sampling defaults for what requests leave unset: ``auto`` (the checkpoint's
    ``generation_config.json``), ``vllm`` (Tandem's own) or a directory holding one."""
    metrics_port: int | None = None
    """Serve Prometheus ``GET /metrics`` here (0: a free port); ``None``: no endpoint."""
    readiness: ReadinessRule = ReadinessRule()
    """Worker counts below which the router reports ``NOT_SERVING``."""
    stall: StallPolicy = StallPolicy()
    """When a decode stream that sends nothing is moved to another worker."""
    api_keys: ApiKeys | None = None
    """Keys the public service requires (``None``: open)."""
    tls: TLSFiles | None = None
    """TLS on the public port (``None``: plaintext)."""
    internal_tls: InternalTLS | None = None
    """Mutual TLS to the workers (``None``: plaintext)."""
    health_port: int | None = None
    """A plaintext port answering gRPC health alone (for probes), when set."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API here (0: a free port); ``None``: no HTTP."""
    rate_limit: RateLimit | None = None
    """Per-API-key request rate, shared through Redis (needs ``api_keys``)."""
    drain_timeout_s: float = 25.0
    """On SIGTERM: how long client streams in flight may still run (new ones are refused
    and readiness turns ``NOT_SERVING`` at once)."""
    model_aliases: tuple[str, ...] = ()
    """More names requests may give the model (vLLM's further --served-model-name)."""
    chat_template: str | None = None
    """A chat template replacing the checkpoint's: a file's path or the template itself."""
    tool_call_parser: str | None = None
    lora_cold_load_tokens: int = DEFAULT_COLD_LOAD_TOKENS
    """See ``OrchestratorConfig.lora_cold_load_tokens``."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (they make every
    worker read a path the caller names: off unless asked for, as in vLLM)."""
    """How ``tool_choice: auto`` finds calls in the output (``None``: auto is refused)."""
    rebalance: RebalanceConfig = RebalanceConfig()
    """Moving streams off a decode worker whose KV pool or batch is fuller than its
    peers' (off by default: ``interval_s`` 0)."""


@dataclass
class RouterState:
    """What a running router exposes to whoever started it in-process (tests, benches)."""

    orchestrator: Orchestrator
    indexer: KVIndexer | None
    metrics: RouterMetrics
    port: int
    metrics_port: int | None
    http_port: int | None = None


def workers_max_model_len(watcher: RegistryWatcher) -> int | None:
    """The smallest ``max_model_len`` the live workers report (``None``: none reports
    one): a prompt longer than that could be refused by the worker it is routed to."""
    limits = (
        record.info.capacity.max_model_len
        for role in WorkerRole
        for record in watcher.workers(role)
    )
    return min((n for n in limits if n is not None), default=None)


def workers_adapters(watcher: RegistryWatcher) -> dict[str, str]:
    """The LoRA adapters the live decode workers hold (name -> KV namespace): the names
    a request may give as its model besides the base model's. A decode worker must hold
    the adapter (it runs every request); a prefill pool without it leaves the prompt to
    the decode worker."""
    adapters: dict[str, str] = {}
    for record in watcher.workers(WorkerRole.DECODE):
        adapters.update(record.load.adapters)
    return adapters


def _start_metrics(options: RouterOptions, metrics: RouterMetrics) -> MetricsServer | None:
    """The Prometheus endpoint, when ``metrics_port`` is set (announced for launchers)."""
    if options.metrics_port is None:
        return None
    server = MetricsServer(metrics.registry, options.host, options.metrics_port)
    log.info("metrics at http://%s:%d/metrics", options.host, server.port)
    print(f"METRICS {server.port}", flush=True)  # for a launcher (before READY)
    return server


async def _start_http(
    options: RouterOptions,
    generator: Generator,
    limiter: RateLimiter | None,
    ready: Callable[[], bool],
    fleet: LoRAFleet,
) -> HttpServer:
    """The OpenAI-compatible HTTP API on ``http_port`` (imported only when served)."""
    from tandem.router.openai_api.app import make_app
    from tandem.router.openai_api.server import HttpServer

    app = make_app(
        generator,
        options.api_keys,
        limiter,
        ready,
        options.tool_call_parser,
        fleet if options.allow_runtime_lora_updating else None,
    )
    http = HttpServer(app, options.host, options.http_port, options.tls, options.drain_timeout_s)
    await http.start()
    scheme = "http" if options.tls is None else "https"
    log.info("OpenAI-compatible API at %s://%s:%d/v1", scheme, options.host, http.port)
    print(f"{HTTP_PREFIX}{http.port}", flush=True)  # for a launcher (before READY)
    return http


async def run(
    options: RouterOptions,
    stop: asyncio.Event | None = None,
    started: asyncio.Future[RouterState] | None = None,
) -> None:
    """Serve until ``stop`` (default: SIGINT/SIGTERM); ``started`` gets the live state."""
    whole_process = stop is None  # run by a command, not embedded in another program
    # The checkpoint's files first: a missing or broken one fails before anything starts.
    validator = RequestValidator.from_dir(
        options.model_dir,
        options.model_name,
        options.max_model_len,
        options.generation_config,
        lambda: workers_max_model_len(watcher),
        options.chat_template,
        options.model_aliases,
        lambda: workers_adapters(watcher),
    )
    stop = stop or stop_on_signals()
    clients = WorkerClients(options.internal_tls)
    metrics = RouterMetrics(options.model_name)
    inflight = InflightLoad()
    prefill_policy = make_policy(options.prefill_policy, WorkerRole.PREFILL, options.prefill_cost)
    decode_policy = make_policy(options.decode_policy, WorkerRole.DECODE, options.decode_cost)
    indexer: KVIndexer | None = None
    consumer: KVEventConsumer | None = None
    if prefill_policy.uses_prefix_match or decode_policy.uses_prefix_match:
        indexer = KVIndexer()
        consumer = KVEventConsumer(
            options.redis_url,
            options.model_name,
            indexer,
            grpc_snapshot_fetcher(clients),
            metrics,
        )
        await consumer.start()  # before the registry's first read, whose joins snapshot
    background: set[asyncio.Task[None]] = set()
    readiness = ReadinessTracker(options.readiness, lambda role: len(watcher.workers(role)))

    fleet: LoRAFleet | None = None  # set once the watcher exists

    def on_join(worker: WorkerRecord) -> None:
        readiness.update()
        if consumer is not None:
            consumer.worker_joined(worker)
        if fleet is not None:
            fleet.worker_joined(worker)

    def on_leave(worker: WorkerRecord) -> None:
        readiness.update()
        if consumer is not None:
            consumer.worker_left(worker)
        inflight.forget(worker.info.worker_id)
        task = asyncio.get_running_loop().create_task(clients.forget(worker))
        background.add(task)
        task.add_done_callback(background.discard)

    watcher = RegistryWatcher(
        options.redis_url, options.model_name, on_join=on_join, on_leave=on_leave
    )
    fleet = LoRAFleet(watcher, clients, validator.served_names)
    await watcher.start()
    orchestrator = Orchestrator(
        watcher,
        clients,
        prefill_policy,
        decode_policy,
        OrchestratorConfig(
            disaggregation_min_tokens=options.disaggregation_min_tokens,
            max_local_prefill_tokens=options.max_local_prefill_tokens,
            stall=options.stall,
            lora_cold_load_tokens=options.lora_cold_load_tokens,
        ),
        indexer=indexer,
        inflight=inflight,
        metrics=metrics,
    )
    limiter = None
    if options.rate_limit is not None:
        if options.api_keys is None:
            raise ValueError("per-key rate limits need API keys")
        limiter = RateLimiter(options.redis_url, options.rate_limit)
    generator = Generator(
        validator,
        Tokenizer.from_dir(options.model_dir),
        orchestrator,
        options.max_pending_requests,
        metrics,
    )
    service = GenerationService(generator)
    server = await start_server(
        options.host,
        options.port,
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(service, s)],
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        ready=False,
        interceptors=()
        if options.api_keys is None
        else (ApiKeyInterceptor(options.api_keys, limiter),),
        tls=options.tls,
        health_port=options.health_port,
    )
    await readiness.attach(server.set_serving)
    metrics.watch(watcher, indexer, inflight)
    metrics_server = _start_metrics(options, metrics)
    metrics_port = None if metrics_server is None else metrics_server.port
    if server.health_port is not None:
        log.info("plaintext gRPC health (for probes) at %s:%d", options.host, server.health_port)
    http = None
    if options.http_port is not None:
        http = await _start_http(options, generator, limiter, lambda: server.ready, fleet)
    if started is not None:
        started.set_result(
            RouterState(
                orchestrator,
                indexer,
                metrics,
                server.port,
                metrics_port,
                None if http is None else http.port,
            )
        )
    rebalancer = None
    if options.rebalance.enabled:
        rebalancer = Rebalancer(watcher, clients, options.rebalance)
        task = asyncio.create_task(rebalancer.run(), name="rebalance")
        background.add(task)
        task.add_done_callback(background.discard)
    print(f"READY router {options.host}:{server.port}", flush=True)
    try:
        await stop.wait()
        if whole_process:
            arm_exit_watchdog(options.drain_timeout_s + SHUTDOWN_GRACE_S)
    finally:
        for task in list(background):
            if task.get_name() == "rebalance":
                task.cancel()
        log.info("draining: up to %.0f s for the streams in flight", options.drain_timeout_s)
        http_stopped = http.stop() if http is not None else asyncio.sleep(0)
        await asyncio.gather(server.stop(options.drain_timeout_s), http_stopped)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)
        await watcher.stop()
        if limiter is not None:
            await limiter.aclose()
        if consumer is not None:
            await consumer.stop()
        await clients.close()
