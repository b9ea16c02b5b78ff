"""A whole Tandem cluster on one machine, as separate processes: Redis (embedded unless
a URL is given), N prefill workers, M decode workers and a router.

Used by ``tandem serve`` and by the end-to-end tests. ``start()`` returns once every
process reported ready, the router sees every worker in the registry *and* its gRPC
health (its readiness) says ``SERVING``; ``stop()`` sends SIGTERM to all (each
deregisters and drains), then SIGKILL after a grace period.
Children's output goes to one log file per process (``log_dir``) or is echoed with a
``[name]`` prefix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cli.options import CommandError
from tandem.common.client import auth_metadata, worker_status
from tandem.common.redis_server import EmbeddedRedis
from tandem.common.tls import InternalTLS, internal_sync_channel
from tandem.protos import generation_pb2, generation_pb2_grpc, worker_pb2

if TYPE_CHECKING:
    from tandem.planner.loop import Endpoints
    from tandem.tools.certs import IssuedCerts

READY_PREFIX = "READY "
METRICS_PREFIX = "METRICS "
HTTP_PREFIX = "HTTP "
"""The router's ``HTTP <port>`` line: its OpenAI API's port (``router.main.HTTP_PREFIX``)."""
"""A component's ``METRICS <port>`` line: where its ``/metrics`` is (before READY)."""


class ClusterStartError(CommandError):
    """A process died or did not become ready in time; the message names it."""


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    router_port: int = 50051
    host: str = "127.0.0.1"
    redis_url: str | None = None
    model_name: str | None = None
    worker_args: tuple[str, ...] = ()
    """Extra flags for every worker (engine options such as ``--max-num-seqs 64``)."""
    prefill_args: tuple[str, ...] = ()
    """Extra flags for prefill workers only, after ``worker_args``."""
    decode_args: tuple[str, ...] = ()
    """Extra flags for decode workers only (e.g. ``--draft-model DIR``)."""
    router_args: tuple[str, ...] = ()
    threads_per_worker: int | None = None
    """Torch threads per worker; default: the machine's cores shared among workers."""
    log_dir: Path | None = None
    env: tuple[tuple[str, str], ...] = ()
    log_level: str = "INFO"
    """Every component's ``--log-level``."""
    restart: bool = False
    """Restart a component that dies after start-up (``tandem serve``), with backoff.
    Off for tests, which kill components on purpose and watch what follows."""
    tls_dir: Path | None = None
    """Mutual TLS on every internal link and TLS on the router's public port, with the
    certificates ``tandem certs`` writes here (made at start if the directory has no CA)."""
    worker_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Extra environment for one worker, by name (``decode-1``: a fault plan, say); a
    restarted worker gets it again."""
    api_keys: tuple[str, ...] = ()
    """Keys the router requires (passed in its environment, not its command line); the
    launcher's own calls present the first."""
    metrics_port: int | None = None
    """Prometheus ``/metrics`` on every component: the router on this port, then each
    prefill and decode worker on the next ones in order (``tandem serve --metrics-port
    9400``: router 9400, prefill-0 9401, ...; a restarted component keeps its port);
    0: each binds a free port itself and reports it (``METRICS <port>`` on its stdout);
    ``None``: off."""


class ComponentCommands:
    """Each component's ``tandem`` command line and extra environment for a cluster
    ``spec``: what ``LocalCluster`` runs as processes and the Ray launcher
    (``tandem.ray``) runs in actors. ``certs``: the cluster's TLS certificates, if any.

    The Redis URL is not part of either (the runner knows it); fixed metrics ports are
    handed out here, in the order of ``ClusterSpec.metrics_port``, one per name."""

    def __init__(self, spec: ClusterSpec, certs: IssuedCerts | None) -> None:
        self.spec = spec
        self.certs = certs
        self._fixed_metrics_ports: dict[str, int] = {}

    def router(self) -> list[str]:
        port = ("--port", str(self.spec.router_port))
        return self._command("router", *port, *self._metrics("router"), *self.spec.router_args)

    def worker(self, role: str, name: str) -> list[str]:
        """Worker ``name`` (``prefill-0``, ``decode-1``, ...) of ``role``."""
        threads = self.spec.threads_per_worker or max(
            1, (os.cpu_count() or 1) // max(1, self.spec.num_prefill + self.spec.num_decode)
        )
        return self._command(
            f"{role}-worker",
            "--worker-id",
            name,
            "--num-threads",
            str(threads),
            *self._metrics(name),
            *self.spec.worker_args,
            *(self.spec.prefill_args if role == "prefill" else self.spec.decode_args),
        )

    def env(self, name: str) -> dict[str, str]:
        """Environment component ``name`` needs beyond the Redis URL: the spec's, the
        worker's own (``worker_env``), the router's API keys (kept off its command line)."""
        from tandem.router.auth import ENV_VAR as KEYS_ENV

        env = {**dict(self.spec.env), **self.spec.worker_env.get(name, {})}
        if name == "router" and self.spec.api_keys:
            env[KEYS_ENV] = ",".join(self.spec.api_keys)
        return env

    def _command(self, command: str, *extra: str) -> list[str]:
        args = [
            command,
            "--model",
            self.spec.model_dir,
            "--host",
            self.spec.host,
            "--log-level",
            self.spec.log_level,
        ]
        if self.spec.model_name:
            args += ["--model-name", self.spec.model_name]
        if self.certs is not None:
            identity = "router" if command == "router" else command.removesuffix("-worker")
            args += [
                "--ssl-certfile",
                str(self.certs.cert(identity)),
                "--ssl-keyfile",
                str(self.certs.key(identity)),
                "--ssl-ca-certs",
                str(self.certs.ca),
            ]
        return [*args, *extra]

    def _metrics(self, name: str) -> list[str]:
        """Fixed ports are handed out here; with 0 the component binds a free one itself
        (no window in which another process could take a port picked for it)."""
        base = self.spec.metrics_port
        if base is None:
            return []
        if not base:
            return ["--metrics-port", "0"]
        if name not in self._fixed_metrics_ports:
            order = [
                "router",
                *(f"prefill-{i}" for i in range(self.spec.num_prefill)),
                *(f"decode-{i}" for i in range(self.spec.num_decode)),
            ]
            used = set(self._fixed_metrics_ports.values())
            port = base + order.index(name) if name in order else max(used) + 1
            self._fixed_metrics_ports[name] = port
        return ["--metrics-port", str(self._fixed_metrics_ports[name])]


RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Delay before the n-th restart in a row; a component up for ``STABLE_S`` starts over."""
STABLE_S = 60.0


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[str]
    args: list[str]
    env: dict[str, str]
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    metrics_port: int | None = None
    """From its ``METRICS <port>`` line."""
    http_port: int | None = None
    """The router's, from its ``HTTP <port>`` line."""
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.redis: EmbeddedRedis | None = None
        self.redis_url = spec.redis_url or ""
        self.children: dict[str, _Child] = {}
        self.num_restarts = 0
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.certs: IssuedCerts | None = None
        self.commands = ComponentCommands(spec, None)

    @property
    def ca_certificates(self) -> bytes | None:
        """PEM roots a client needs for the router's port (``None``: plaintext)."""
        return None if self.certs is None else self.certs.ca.read_bytes()

    @property
    def api_key(self) -> str | None:
        return self.spec.api_keys[0] if self.spec.api_keys else None

    def router_channel(self) -> grpc.Channel:
        """A blocking channel to the router's public port, TLS when the cluster has it."""
        if self.certs is None:
            return grpc.insecure_channel(self.router_address)
        credentials = grpc.ssl_channel_credentials(self.ca_certificates)
        return grpc.secure_channel(self.router_address, credentials)

    def worker_channel(self, name: str) -> grpc.Channel:
        """A blocking channel to a worker, presenting the router's certificate under mTLS."""
        return internal_sync_channel(self.worker_address(name), self._internal_tls("router"))

    def worker_status(self, name: str) -> worker_pb2.WorkerStatus:
        """``GetStatus`` of worker ``name`` (``prefill-0``, ``decode-1``, ...)."""
        with self.worker_channel(name) as channel:
            return worker_status(channel, name.split("-")[0])

    @property
    def router_address(self) -> str:
        """``host:port`` of the router: as its READY line says once it is up (so
        ``--port 0``, a free port, works), the configured one before."""
        router = self.children.get("router")
        if router is not None and router.ready_line:
            return router.ready_line.split()[-1]
        return f"{self.spec.host}:{self.spec.router_port}"

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the router's OpenAI API, as its ``HTTP`` line says (``None``:
        not served)."""
        router = self.children.get("router")
        if router is None or router.http_port is None:
            return None
        return f"{self.spec.host}:{router.http_port}"

    @property
    def model_name(self) -> str:
        return self.spec.model_name or Path(self.spec.model_dir).resolve().name

    def worker_address(self, name: str) -> str:
        """``host:port`` of a started component (from its READY line)."""
        return self.children[name].ready_line.split()[-1]

    def start(self, timeout_s: float = 180.0) -> LocalCluster:
        try:
            if self.spec.tls_dir is not None:
                self.certs = certificates(self.spec.tls_dir, self.spec.host)
            self.commands = ComponentCommands(self.spec, self.certs)
            if not self.redis_url:
                self.redis = EmbeddedRedis().start()
                self.redis_url = self.redis.url
            for i in range(self.spec.num_prefill):
                self.start_worker("prefill", f"prefill-{i}")
            for i in range(self.spec.num_decode):
                self.start_worker("decode", f"decode-{i}")
            self._spawn("router", self._python(self.commands.router()), self.commands.env("router"))
            self.wait_ready(list(self.children), timeout_s)
            self.wait_for_workers(self.spec.num_prefill, self.spec.num_decode, timeout_s)
            self.wait_router_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        if self.spec.restart:
            self._supervisor = threading.Thread(
                target=self._supervise, daemon=True, name="supervisor"
            )
            self._supervisor.start()
        return self

    def start_worker(self, role: str, name: str, env: Mapping[str, str] | None = None) -> None:
        """Spawn one worker (also used by tests to add or replace workers); ``env``:
        extra environment for this worker alone."""
        args = self._python(self.commands.worker(role, name))
        self._spawn(name, args, {**self.commands.env(name), **(env or {})})

    def wait_ready(self, names: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            child = self.children[name]
            while not child.ready.wait(0.1):
                if child.process.poll() is not None:
                    raise ClusterStartError(
                        f"{name} exited with code {child.process.returncode}{self._log_hint(name)}"
                    )
                if time.monotonic() > deadline:
                    raise ClusterStartError(
                        f"{name} not ready after {timeout_s:.0f} s{self._log_hint(name)}"
                    )

    def wait_for_workers(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        """Until the router's registry view holds exactly these worker counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            model = self.model_info()
            if (model.num_prefill_workers, model.num_decode_workers) == (num_prefill, num_decode):
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"router sees {model.num_prefill_workers} prefill / {model.num_decode_workers}"
                    f" decode workers, expected {num_prefill} / {num_decode}"
                )
            time.sleep(0.1)

    def wait_router_serving(self, timeout_s: float) -> None:
        """Until the router's gRPC health (its readiness) says ``SERVING``."""
        deadline = time.monotonic() + timeout_s
        while self.router_health() != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise ClusterStartError(f"router not SERVING after {timeout_s:.0f} s")
            time.sleep(0.1)

    def router_health(self, service: str = "") -> int:
        with self.router_channel() as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10.0).status

    def model_info(self) -> generation_pb2.ModelInfo:
        with self.router_channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.ListModelsRequest()
            models = stub.ListModels(request, timeout=10.0, metadata=auth_metadata(self.api_key))
            return models.models[0]

    def workers(self, role: str) -> list[str]:
        """Names of the running workers of ``role``, oldest first."""
        return sorted(
            (n for n in self.children if n.startswith(f"{role}-")),
            key=lambda n: int(n.rsplit("-", 1)[1]),
        )

    def scale(self, role: str, replicas: int, timeout_s: float = 180.0) -> None:
        """Add workers of ``role`` (ready before this returns) or retire the newest: a
        retired worker is sent SIGTERM, so it leaves the registry and drains its streams
        (what it cannot finish moves to a peer) before it exits; it is not restarted."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        current = self.workers(role)
        if replicas > len(current):
            used = [int(n.rsplit("-", 1)[1]) for n in current]
            start = max(used, default=-1) + 1
            names = [f"{role}-{start + i}" for i in range(replicas - len(current))]
            for name in names:
                self.start_worker(role, name)
            self.wait_ready(names, timeout_s)
        for name in reversed(current[replicas:]):
            self.kill(name, signal.SIGTERM)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children.pop(name)
        child.process.send_signal(sig)
        child.process.wait(timeout=30)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to every component (each drains: see ``--drain-timeout``), SIGKILL to
        those still running after ``grace_s``. The router goes first: the front door
        closes, its streams finish on workers still up, and it does not see the workers
        leave (nor warn that it cannot route)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        deadline = time.monotonic() + grace_s
        router = [c for name, c in self.children.items() if name == "router"]
        workers = [c for name, c in self.children.items() if name != "router"]
        for group in (router, workers):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- helpers -----------------------------------------------------------------------

    @staticmethod
    def _python(command: list[str]) -> list[str]:
        return [sys.executable, "-m", "tandem.cli", *command]

    @property
    def metrics_ports(self) -> dict[str, int]:
        """Component name -> its ``/metrics`` port, router first (empty when off)."""
        ports = {n: c.metrics_port for n, c in self.children.items() if c.metrics_port}
        return dict(sorted(ports.items(), key=lambda item: item[0] != "router"))

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each component's ``/metrics`` URL, the router first."""
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "::", "") else self.spec.host
        return {n: f"http://{host}:{p}/metrics" for n, p in self.metrics_ports.items()}

    def planner_endpoints(self) -> Endpoints:
        """The ``/metrics`` URLs the planner reads, per pool (workers without one left out)."""
        from tandem.planner.loop import Endpoints

        urls = self.metrics_urls
        return Endpoints(
            urls.get("router", ""),
            [urls[n] for n in self.workers("prefill") if n in urls],
            [urls[n] for n in self.workers("decode") if n in urls],
        )

    def _internal_tls(self, identity: str) -> InternalTLS | None:
        if self.certs is None:
            return None
        return InternalTLS(self.certs.ca, self.certs.cert(identity), self.certs.key(identity))

    def _supervise(self) -> None:
        """Restart components that died, with backoff, until ``stop``."""
        while not self._stopping.wait(0.5):
            for name, child in list(self.children.items()):
                code = child.process.poll()
                if code is None or self.children.get(name) is not child:
                    continue
                up_s = time.monotonic() - child.started_at
                streak = 0 if up_s >= STABLE_S else child.restarts
                delay = RESTART_BACKOFF_S[min(streak, len(RESTART_BACKOFF_S) - 1)]
                print(
                    f"[launcher] {name} exited with code {code} after {up_s:.0f} s; "
                    f"restarting in {delay:g} s",
                    flush=True,
                )
                if self._stopping.wait(delay):
                    return
                self._spawn(name, child.args, child.env)
                self.children[name].restarts = streak + 1
                self.num_restarts += 1

    def _spawn(
        self, name: str, args: list[str], extra_env: Mapping[str, str] | None = None
    ) -> None:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # in the environment, not on the command line, where any user's `ps` sees it
            "TANDEM_REDIS_URL": self.redis_url,
            **(extra_env or {}),
        }
        process = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
        )
        child = _Child(name, process, args, dict(extra_env or {}))
        self.children[name] = child
        sink = self._sink(name)
        threading.Thread(target=_pump, args=(child, sink), daemon=True, name=f"log-{name}").start()

    def _sink(self, name: str) -> TextIO | None:
        if self.spec.log_dir is None:
            return None
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.spec.log_dir / f"{name}.log", "a", buffering=1)

    def _log_hint(self, name: str) -> str:
        return f" (see {self.spec.log_dir / f'{name}.log'})" if self.spec.log_dir else ""


def _pump(child: _Child, sink: TextIO | None) -> None:
    """Copy a child's output to its log (or our stdout) and notice its READY line."""
    assert child.process.stdout is not None
    try:
        for line in child.process.stdout:
            if line.startswith(METRICS_PREFIX):
                child.metrics_port = int(line.split()[1])
            if line.startswith(HTTP_PREFIX):
                child.http_port = int(line.split()[1])
            if line.startswith(READY_PREFIX) and not child.ready.is_set():
                child.ready_line = line.strip()
                child.ready.set()
            if sink is not None:
                sink.write(line)
            else:
                sys.stdout.write(f"[{child.name}] {line}")
    finally:
        if sink is not None:
            sink.close()


def certificates(directory: Path, host: str) -> IssuedCerts:
    """The certificates in ``directory``, made there first if it holds no CA."""
    from tandem.tools.certs import DEFAULT_COMPONENTS, IssuedCerts, make_certs

    if (directory / "ca.pem").is_file():
        issued = IssuedCerts(directory, DEFAULT_COMPONENTS)
        for name in DEFAULT_COMPONENTS:
            if not issued.cert(name).is_file() or not issued.key(name).is_file():
                raise ValueError(f"{directory} has a CA but no {issued.cert(name).name}")
        return issued
    hosts = () if host in ("0.0.0.0", "", "::") else (host,)
    return make_certs(directory, DEFAULT_COMPONENTS, hosts)
