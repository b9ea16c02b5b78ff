"""The driver's side: connect to Ray (or start a local one), start a cluster's controller
and stop it with nothing left behind; find a running cluster's controller from another
process (``tandem scale``, the planner).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import TYPE_CHECKING

import grpc
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cli.launcher import ClusterSpec, certificates
from tandem.cli.options import CommandError
from tandem.common.client import worker_status
from tandem.common.tls import InternalTLS, internal_sync_channel
from tandem.protos import worker_pb2
from tandem.ray.controller import CONTROLLER, ClusterStatus
from tandem.ray.spec import CONTROLLER as CONTROLLER_NAME
from tandem.ray.spec import NAMESPACE, RaySpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tandem.planner.loop import Endpoints
    from tandem.tools.certs import IssuedCerts

OBJECT_STORE_BYTES = 100 * 2**20
"""A local Ray's object store: Tandem moves KV over torch.distributed, not Ray objects."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class NoCluster(CommandError):
    """No Tandem controller in the namespace asked for."""


def connect(address: str | None, namespace: str, num_cpus: int | None = None, **local) -> bool:
    """Join the Ray at ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) or,
    with ``None``, start a local one (``num_cpus``, ``local``: more ``ray.init``
    settings); nothing when this process is connected already. Returns whether it
    started Ray (and so should shut it down). An unreachable address raises
    ``ConnectionError`` at once, naming it."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(
            address="local",
            namespace=namespace,
            num_cpus=num_cpus,
            object_store_memory=OBJECT_STORE_BYTES,
            **local,
        )
        return True
    if address not in ("auto", "local"):
        _check_reachable(address)
    try:
        ray.init(address=address, namespace=namespace)
    except ConnectionError as err:
        raise ConnectionError(f"--ray-address {address}: {err}") from None
    return False


def controller(namespace: str = NAMESPACE) -> ActorHandle:
    """The running cluster's controller in ``namespace`` (this process must be
    connected to Ray); raises ``NoCluster`` when there is none."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        raise NoCluster(
            f"no Tandem cluster on this Ray: no actor {CONTROLLER_NAME!r} in namespace "
            f"{namespace!r} (start one with `tandem serve --ray`; `ray list actors` lists them)"
        ) from None


def scale(
    role: str,
    replicas: int,
    *,
    address: str = "auto",
    namespace: str = NAMESPACE,
    timeout_s: float = 300.0,
) -> None:
    """Scale the running cluster's ``role`` pool to ``replicas`` (see
    ``Controller.scale``: new replicas serve before this returns, retired ones drain).
    Joins the Ray at ``address`` unless this process is connected already."""
    connect(address, namespace)
    ray.get(controller(namespace).scale.remote(role, replicas, timeout_s))


class RayCluster:
    """A Tandem cluster on Ray: ``start()`` connects (or starts a local Ray), refuses
    a namespace that already has a cluster, starts the controller and returns once the
    router serves every replica; ``stop()`` drains and removes every actor and
    placement group, then shuts Ray down if it started it."""

    def __init__(self, spec: ClusterSpec, ray_spec: RaySpec | None = None) -> None:
        ray_spec = ray_spec or RaySpec()
        if spec.threads_per_worker is None:  # a rank's torch threads: its CPUs
            threads = max(1, int(ray_spec.prefill.cpus), int(ray_spec.decode.cpus))
            spec = dataclasses.replace(spec, threads_per_worker=threads)
        self.spec = spec
        self.ray_spec = ray_spec
        self.certs: IssuedCerts | None = None
        self.controller: ActorHandle | None = None
        self.started_ray = False
        self._owner = True
        """Whether this object started the cluster (and so ``stop`` tears it down)."""
        self._status: ClusterStatus | None = None

    @classmethod
    def attach(cls, address: str | None = "auto", namespace: str = NAMESPACE) -> RayCluster:
        """The cluster already running in ``namespace`` on the Ray at ``address``
        (``None``: the Ray this process is connected to), to look at and scale; its
        ``stop`` only disconnects. Raises ``NoCluster`` when there is none."""
        connect(address, namespace)
        handle = controller(namespace)
        spec, ray_spec, certs = ray.get(handle.specs.remote(), timeout=60)
        cluster = cls(spec, ray_spec)
        cluster.controller, cluster.certs, cluster._owner = handle, certs, False
        cluster.status()
        return cluster

    def start(self, timeout_s: float = 300.0) -> RayCluster:
        self.started_ray = connect(
            self.ray_spec.address,
            self.ray_spec.namespace,
            num_cpus=self._local_cpus(),
            include_dashboard=self.ray_spec.include_dashboard,
        )
        try:
            self._check_fits_nodes()
            self._refuse_second_cluster()
            if self.spec.tls_dir is not None:
                self.certs = certificates(self.spec.tls_dir, self.spec.host)
            home = ray.get_runtime_context().get_node_id()
            self.controller = CONTROLLER.options(
                name=CONTROLLER_NAME,
                namespace=self.ray_spec.namespace,
                scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=True),
            ).remote(self.spec, self.ray_spec, self.certs, home)
            self._status = _unwrapped(self.controller.start.remote(timeout_s))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if not self._owner:
            self.controller = None
            return
        if self.controller is not None:
            try:
                ray.get(self.controller.shutdown.remote())
            finally:
                ray.kill(self.controller, no_restart=True)
                self.controller = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what runs -----------------------------------------------------------------------

    def status(self) -> ClusterStatus:
        """Asked of the controller now (addresses change when a replica restarts)."""
        assert self.controller is not None, "not started"
        self._status = ray.get(self.controller.status.remote())
        return self._status

    def scale(self, role: str, replicas: int, timeout_s: float = 300.0) -> None:
        assert self.controller is not None, "not started"
        _unwrapped(self.controller.scale.remote(role, replicas, timeout_s))

    def workers(self, role: str) -> list[str]:
        return self.status().workers(role)

    @property
    def router_address(self) -> str:
        assert self._status is not None, "not started"
        return self._status.router.address

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the router's OpenAI API (``None``: not served)."""
        assert self._status is not None, "not started"
        router = self._status.router
        if router.http_port is None:
            return None
        return f"{router.address.rsplit(':', 1)[0]}:{router.http_port}"

    @property
    def redis_url(self) -> str:
        """The registry's URL (the embedded Redis actor's, unless one was given)."""
        assert self._status is not None, "not started"
        return self._status.redis_url

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each running component's ``/metrics`` URL, the router first."""
        s = self.status()
        endpoints = [s.router, *(e for pairs in s.replicas.values() for _, e in pairs if e)]
        return {e.name: e.metrics_url for e in endpoints if e.metrics_url}

    @property
    def model_name(self) -> str:
        from pathlib import Path

        return self.spec.model_name or Path(self.spec.model_dir).resolve().name

    @property
    def api_key(self) -> str | None:
        return self.spec.api_keys[0] if self.spec.api_keys else None

    @property
    def ca_certificates(self) -> bytes | None:
        return None if self.certs is None else self.certs.ca.read_bytes()

    @property
    def ray_address(self) -> str:
        """The GCS address other Ray processes join (``tandem scale --ray-address``)."""
        return ray.get_runtime_context().gcs_address

    def worker_channel(self, name: str) -> grpc.Channel:
        """A blocking channel to worker ``name``, as the router (mTLS when on)."""
        endpoint = self.status().endpoint(name)
        if endpoint is None:
            raise CommandError(f"{name} is restarting: no address yet")
        tls = None
        if self.certs is not None:
            c = self.certs
            tls = InternalTLS(c.ca, c.cert("router"), c.key("router"))
        return internal_sync_channel(endpoint.address, tls)

    def worker_status(self, name: str) -> worker_pb2.WorkerStatus:
        """``GetStatus`` of worker ``name`` (``prefill-0``, ``decode-1``, ...)."""
        with self.worker_channel(name) as channel:
            return worker_status(channel, name.split("-")[0])

    def planner_endpoints(self) -> Endpoints:
        """Every component's ``/metrics`` URL (replicas restarting are left out)."""
        from tandem.planner.loop import Endpoints

        s = self.status()
        urls = {
            role: [e.metrics_url for _, e in s.replicas[role] if e and e.metrics_url]
            for role in s.replicas
        }
        return Endpoints(s.router.metrics_url or "", urls["prefill"], urls["decode"])

    # --- checks --------------------------------------------------------------------------

    def _local_cpus(self) -> int:
        """A local Ray's CPUs: the machine's, or what the replicas reserve if more
        (Ray's CPUs are a reservation; each rank's threads are ``--num-threads``)."""
        tp = self.ray_spec.tensor_parallel_size
        wanted = tp * (
            self.spec.num_prefill * self.ray_spec.prefill.cpus
            + self.spec.num_decode * self.ray_spec.decode.cpus
        )
        return self.ray_spec.num_cpus or max(os.cpu_count() or 1, int(wanted + 0.999))

    def _check_fits_nodes(self) -> None:
        """Components on different nodes must reach Redis and each other."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) < 2:
            return
        missing = []
        if self.spec.redis_url is None:
            missing.append("--redis-url (a Redis every node reaches; the embedded one is local)")
        if self.spec.host in LOOPBACK:
            missing.append("--host 0.0.0.0 (components listen on loopback by default)")
        if missing:
            raise ValueError(
                f"this Ray cluster has {len(nodes)} nodes, so replicas may land on any of "
                f"them: pass {' and '.join(missing)}"
            )

    def _refuse_second_cluster(self) -> None:
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=self.ray_spec.namespace)
        except ValueError:
            return
        raise CommandError(
            f"a Tandem cluster already runs in Ray namespace {self.ray_spec.namespace!r} "
            f"({CONTROLLER_NAME}): stop it, or pass --ray-namespace"
        )


def _unwrapped(ref: ray.ObjectRef) -> object:
    """``ray.get``, raising the controller's own error (one line) rather than Ray's
    wrapper with the remote traceback."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = err.cause
        if isinstance(cause, CommandError | ValueError):
            raise type(cause)(*cause.args) from None
        raise


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast where ``ray.init`` would retry for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address} ({reason}): is Ray running there? "
            "--ray-address takes auto (a cluster `ray start` began on this machine), "
            "HOST:PORT of its head (port 6379 by default) or ray://HOST:10001 (Ray Client)"
        ) from None
