"""What every worker process does around its engine: serve gRPC, stay registered.

Torch-free: the worker packages hand in their servicers and two callables — the
worker's fixed info (once the port is known) and its current load (read every
heartbeat) — and this module runs the server, the registry entry and the heartbeats
until asked to stop, then deregisters before the server goes away, so routers stop
sending traffic first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tandem.common.grpc_server import AddServicer, RunningServer, start_server
from tandem.common.lora import LoRARequest
from tandem.common.metrics import ComponentMetrics, MetricsServer
from tandem.common.process import SHUTDOWN_GRACE_S, arm_exit_watchdog, stop_on_signals
from tandem.common.registry import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_TTL_S,
    WorkerInfo,
    WorkerLoad,
    WorkerRegistration,
    WorkerRole,
)
from tandem.common.registry.redis_io import REDIS_ERRORS, FailureLog
from tandem.common.tls import InternalTLS

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 25.0
"""Fits Kubernetes' default 30 s termination grace period with room to exit."""
HANDOFF_GRACE_S = 10.0
"""Beyond the drain, the time a worker's own drain may take to hand its work over."""
AFTER_DRAIN_GRACE_S = 2.0
"""The grace the server gives the calls left after a worker's own drain."""


@dataclass(frozen=True)
class WorkerOptions:
    """One worker process, as its command line describes it."""

    role: WorkerRole
    model_dir: str
    model_name: str
    worker_id: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    """Host other processes use to reach this one (defaults to ``host``)."""
    engine: Mapping[str, object] = field(default_factory=dict)
    """``EngineConfig`` fields other than the model directory."""
    lease_ttl_s: float = 30.0
    kv_store_port: int = 0
    """The KV rendezvous store's TCP port (0: a free one): a prefill worker's, and a
    decode worker's for the streams it hands over."""
    kv_pull_timeout_s: float = 10.0
    registry_ttl_s: float = DEFAULT_TTL_S
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    """On SIGTERM: how long in-flight calls may still run after deregistering."""
    drain_migrate_after_s: float = 0.0
    """Decode: on SIGTERM with a peer decode worker registered, how long streams may
    still run here before they are handed over with their KV."""
    engine_stall_timeout_s: float = 30.0
    """An engine loop that has not advanced for this long makes the worker not ready."""
    tls: InternalTLS | None = None
    """Mutual TLS on this worker's port and on its calls to other workers."""
    health_port: int | None = None
    """A plaintext port answering gRPC health alone (for probes), when set."""
    metrics_port: int | None = None
    """Serve Prometheus ``GET /metrics`` here (0: a free port); ``None``: no endpoint."""
    lora_modules: tuple[LoRARequest, ...] = ()
    """LoRA adapters loaded at start-up (``--lora-modules``)."""

    @property
    def public_host(self) -> str:
        return self.advertise_host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)


EXIT_RANK_LOST = 75
"""Exit status of a worker whose tensor-parallel replica lost a rank."""


def exit_for_restart(reason: str) -> None:
    """A tensor-parallel rank of this worker died: the replica cannot go on, so the whole
    process ends now (its other ranks follow), for its supervisor — the launcher, Ray,
    Kubernetes — to start the replica again; routers move its streams elsewhere."""
    log.critical("%s: exiting (status %d) for a restart of the replica", reason, EXIT_RANK_LOST)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


async def host_worker(
    options: WorkerOptions,
    add_servicers: Sequence[AddServicer],
    service_names: Sequence[str],
    make_info: Callable[[str], WorkerInfo],
    load: Callable[[], WorkerLoad],
    stop: asyncio.Event | None = None,
    engine_stalled_s: Callable[[], float] | None = None,
    metrics: ComponentMetrics | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until ``stop`` is set or SIGINT/SIGTERM arrives. ``make_info(address)``
    builds the registry entry once the bound address is known. ``engine_stalled_s``:
    how long the worker's engine loop has not advanced (``AsyncEngine.stalled_for_s``);
    past ``options.engine_stall_timeout_s`` the worker is not ready (see ``_membership``).
    ``metrics`` are served on ``options.metrics_port`` when it is set. ``drain``: the
    worker's own drain (a decode worker hands its streams over), run once it has left
    the registry and before the server stops; it takes the place of the grace period
    the server would give the calls in flight."""
    whole_process = stop is None  # run by a command, not embedded in another program
    stop = stop or stop_on_signals()
    server = await start_server(
        options.host,
        options.port,
        add_servicers,
        service_names,
        tls=options.tls,
        health_port=options.health_port,
    )
    address = f"{options.public_host}:{server.port}"
    info = make_info(address)
    registration = WorkerRegistration(options.redis_url, ttl_s=options.registry_ttl_s)
    metrics_server = None
    if metrics is not None and options.metrics_port is not None:
        metrics_server = MetricsServer(metrics.registry, options.host, options.metrics_port)
        log.info("metrics at http://%s:%d/metrics", options.public_host, metrics_server.port)
        print(f"METRICS {metrics_server.port}", flush=True)  # for a launcher (before READY)
    try:
        await registration.register(info, load())
        heartbeats = asyncio.create_task(
            _membership(options, registration, server, info, load, engine_stalled_s)
        )
        log.info(
            "%s worker %s serving %s at %s%s",
            info.role.value,
            info.worker_id,
            info.model,
            address,
            "" if server.health_port is None else f" (health also on :{server.health_port})",
        )
        print(f"READY {info.role.value} {info.worker_id} {address}", flush=True)
        await stop.wait()
        if whole_process:
            arm_exit_watchdog(options.drain_timeout_s + HANDOFF_GRACE_S + SHUTDOWN_GRACE_S)
        heartbeats.cancel()
    finally:
        await _leave(registration, server, options.drain_timeout_s, drain)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)


async def _membership(
    options: WorkerOptions,
    registration: WorkerRegistration,
    server: RunningServer,
    info: WorkerInfo,
    load: Callable[[], WorkerLoad],
    engine_stalled_s: Callable[[], float] | None,
) -> None:
    """Heartbeat every ``heartbeat_interval_s`` while the engine advances. While it is
    stuck (no turn of its loop for ``engine_stall_timeout_s``) the worker is not ready:
    its health says ``NOT_SERVING`` and it leaves the registry, so routers send it
    nothing (heartbeats run on this event loop, not the engine's thread, and would
    otherwise keep it listed). It comes back once the engine moves again."""
    failures = FailureLog("registry heartbeat")
    while True:
        stuck = engine_stalled_s is not None and engine_stalled_s() > options.engine_stall_timeout_s
        try:
            if stuck and registration.info is not None:
                log.error("engine loop stuck for %.1f s: leaving the registry", engine_stalled_s())
                await server.set_serving(False)
                await registration.deregister()
            elif not stuck and registration.info is None:
                await registration.register(info, load())
                await server.set_serving(True)
                log.info("engine loop moving again: back in the registry")
            elif registration.info is not None:
                await registration.heartbeat(load())
            failures.succeeded()
        except REDIS_ERRORS as err:
            failures.failed(err)
        await asyncio.sleep(options.heartbeat_interval_s)


async def _leave(
    registration: WorkerRegistration,
    server: RunningServer,
    drain_s: float,
    drain: Callable[[], Awaitable[None]] | None,
) -> None:
    """Drain: leave the registry first (routers stop sending work here), refuse new calls,
    let the calls in flight finish within ``drain_s``, then cancel what is left (the
    router moves a cancelled stream to another worker). With the worker's own ``drain``,
    the server keeps serving (what it refuses is the worker's to say) until that ends."""
    with contextlib.suppress(Exception):
        await registration.deregister()
    with contextlib.suppress(Exception):
        await registration.aclose()
    if drain is not None:
        await server.set_serving(False)
        try:
            await drain()
        except Exception:
            log.exception("the worker's drain failed; stopping now")
        drain_s = AFTER_DRAIN_GRACE_S
    log.info("draining: up to %.0f s for the calls in flight", drain_s)
    await server.stop(drain_s)
