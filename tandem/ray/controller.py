"""The controller: the named actor (``tandem-controller``) that owns a cluster's actors on
Ray — the embedded Redis (unless a URL is given), the router, and one placement group
plus one rank-0 actor per prefill and decode replica — and scales the replica groups.

Everything it creates is owned by it, so Ray removes it all if the controller dies; and
the controller is owned by the ``tandem serve --ray`` process, so a driver that is
killed leaves nothing behind either. Other Ray jobs find it by name in the cluster's
namespace (``tandem scale``, the planner's ``RayActuator``).

Calls run on the actor's threads: ``status`` and ``replicas`` answer while a ``scale``
is under way; ``start``, ``scale`` and ``shutdown`` take turns.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from tandem.cli.launcher import ClusterSpec, ComponentCommands
from tandem.cli.main import parse
from tandem.common.client import auth_metadata
from tandem.common.process import SHUTDOWN_GRACE_S
from tandem.protos import generation_pb2, generation_pb2_grpc
from tandem.ray.component import COMPONENT, REDIS, ComponentFailed, Endpoint
from tandem.ray.spec import RAY_NAMESPACE_ENV, ROLES, ROUTER, RaySpec, actor_name
from tandem.ray.spec import REDIS as REDIS_NAME

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tandem.tools.certs import IssuedCerts


@dataclass
class Replica:
    """One replica of a role: its placement group and its rank-0 actor."""

    name: str
    group: PlacementGroup
    actor: ActorHandle
    drain_s: float
    """Its ``--drain-timeout``."""
    endpoint: Endpoint | None = None

    @property
    def index(self) -> int:
        return int(self.name.rsplit("-", 1)[1])


@dataclass(frozen=True)
class ClusterStatus:
    """What runs now. A replica's endpoint is ``None`` while it starts or restarts."""

    router: Endpoint
    redis_url: str
    replicas: dict[str, list[tuple[str, Endpoint | None]]] = field(default_factory=dict)

    def workers(self, role: str) -> list[str]:
        return [name for name, _ in self.replicas[role]]

    def endpoint(self, name: str) -> Endpoint | None:
        if name == "router":
            return self.router
        return dict(pair for pairs in self.replicas.values() for pair in pairs)[name]


class Controller:
    """Ray actor class (see ``CONTROLLER``). ``certs``: the cluster's TLS certificates
    (made by the driver, at paths every node sees); ``home_node``: where the router
    and the embedded Redis run (the driver's node, so the router's address is the one
    the user expects)."""

    def __init__(
        self, spec: ClusterSpec, ray_spec: RaySpec, certs: IssuedCerts | None, home_node: str
    ) -> None:
        self.spec = spec
        self.ray_spec = ray_spec
        self.certs = certs
        self.commands = ComponentCommands(spec, certs)
        self._home = NodeAffinitySchedulingStrategy(home_node, soft=True)
        self._lock = threading.Lock()
        self._replicas: dict[str, list[Replica]] = {role: [] for role in ROLES}
        self._redis: ActorHandle | None = None
        self._router: ActorHandle | None = None
        self._router_endpoint: Endpoint | None = None
        self._router_drain_s = 0.0
        self.redis_url = spec.redis_url or ""

    def __repr__(self) -> str:
        return "controller"

    def start(self, timeout_s: float = 300.0) -> ClusterStatus:
        """Redis, every replica and the router; returns once the router sees every
        replica and says ``SERVING``. On failure everything started is removed."""
        with self._lock:
            try:
                if not self.redis_url:
                    self._redis = REDIS.options(
                        name=REDIS_NAME,
                        namespace=self.ray_spec.namespace,
                        scheduling_strategy=self._home,
                    ).remote()
                    self.redis_url = ray.get(self._redis.url.remote(), timeout=60)
                counts = {"prefill": self.spec.num_prefill, "decode": self.spec.num_decode}
                new = [
                    self._launch(role, f"{role}-{i}")
                    for role, count in counts.items()
                    for i in range(count)
                ]
                command = self.commands.router()
                self._router_drain_s = parse(command).drain_timeout
                self._router = COMPONENT.options(
                    name=ROUTER,
                    namespace=self.ray_spec.namespace,
                    num_cpus=0,
                    max_restarts=-1,
                    scheduling_strategy=self._home,
                ).remote("router", command, self._env("router"))
                self._await_ready(new, timeout_s)
                self._router_endpoint = _get(self._router.ready.remote(timeout_s))
                self._wait_for_router(self.spec.num_prefill, self.spec.num_decode, timeout_s)
            except BaseException:
                self._teardown()
                raise
        return self.status()

    def scale(self, role: str, replicas: int, timeout_s: float = 300.0) -> None:
        """Add ``role`` replicas (serving before this returns) or retire the newest: a
        retired replica leaves the registry, finishes its calls (what it cannot finish
        within its ``--drain-timeout`` moves to a peer), then its actor and placement
        group are removed."""
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        with self._lock:
            current = self._replicas[role]
            if replicas > len(current):
                first = max((r.index for r in current), default=-1) + 1
                names = [f"{role}-{first + i}" for i in range(replicas - len(current))]
                new = [self._launch(role, name) for name in names]
                try:
                    self._await_ready(new, timeout_s)
                except BaseException:
                    self._remove(role, new)
                    raise
            self._remove(role, current[replicas:])

    def replicas(self, role: str) -> int:
        return len(self._replicas[role])

    def specs(self) -> tuple[ClusterSpec, RaySpec, IssuedCerts | None]:
        """What this cluster was started with (for a process that joins it)."""
        return self.spec, self.ray_spec, self.certs

    def status(self) -> ClusterStatus:
        """Every component's endpoint, asked of each actor now (a replica that
        restarted has a new one)."""
        assert self._router_endpoint is not None, "not started"
        replicas = {role: list(self._replicas[role]) for role in ROLES}
        everyone = [r for group in replicas.values() for r in group]
        refs = [r.actor.endpoint.remote() for r in everyone]
        ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for replica, ref in zip(everyone, refs, strict=True):
            try:
                replica.endpoint = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                replica.endpoint = None  # restarting (or stuck): no address to give
        return ClusterStatus(
            self._router_endpoint,
            self.redis_url,
            {role: [(r.name, r.endpoint) for r in group] for role, group in replicas.items()},
        )

    def shutdown(self) -> None:
        """Drain everything at once (as SIGTERM does to a local cluster), then remove
        every actor and placement group this controller made."""
        with self._lock:
            self._teardown()

    # --- helpers -----------------------------------------------------------------------

    def _env(self, name: str) -> dict[str, str]:
        return {
            **self.commands.env(name),
            "TANDEM_REDIS_URL": self.redis_url,
            RAY_NAMESPACE_ENV: self.ray_spec.namespace,  # where rank 0 names its ranks
        }

    def _launch(self, role: str, name: str) -> Replica:
        """Ask Ray for the replica's placement group and its rank-0 actor in bundle 0."""
        command = self.commands.worker(role, name)
        group = placement_group(
            self.ray_spec.bundles(role),
            strategy="STRICT_PACK",
            name=actor_name(name),
            bundle_label_selector=self.ray_spec.label_selectors(role),
        )
        actor = COMPONENT.options(
            name=actor_name(name),
            namespace=self.ray_spec.namespace,
            max_restarts=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            **self.ray_spec.resources(role).actor_options,
        ).remote(name, command, self._env(name))
        replica = Replica(name, group, actor, parse(command).drain_timeout)
        self._replicas[role].append(replica)
        return replica

    def _await_ready(self, replicas: Sequence[Replica], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for replica in replicas:
            placed, _ = ray.wait([replica.group.ready()], timeout=_left(deadline))
            if not placed:
                raise ComponentFailed(self._unplaced(replica))
        refs = [r.actor.ready.remote(_left(deadline)) for r in replicas]
        for replica, ref in zip(replicas, refs, strict=True):
            replica.endpoint = _get(ref)

    def _unplaced(self, replica: Replica) -> str:
        role = replica.name.split("-")[0]
        labels = self.ray_spec.resources(role).labels
        where = f" on a node labelled {dict(labels)}" if labels else ""
        return (
            f"{replica.name}: Ray found no room for its placement group "
            f"{self.ray_spec.bundles(role)} (STRICT_PACK: one node){where}; free now: "
            f"{ray.available_resources()} (see `ray status`)"
        )

    def _remove(self, role: str, replicas: Sequence[Replica]) -> None:
        """Drain ``replicas`` together, then remove their actors and placement groups."""
        replicas = list(replicas)
        for replica in replicas:
            self._replicas[role].remove(replica)
        _drain([(r.actor, r.drain_s) for r in replicas])
        for replica in replicas:
            ray.kill(replica.actor, no_restart=True)
            remove_placement_group(replica.group)

    def _teardown(self) -> None:
        """Drain the router and every replica at once, remove them, then Redis."""
        everyone = [(role, r) for role in ROLES for r in self._replicas[role]]
        router = [] if self._router is None else [(self._router, self._router_drain_s)]
        _drain([*router, *((r.actor, r.drain_s) for _, r in everyone)])
        for actor, _ in router:
            ray.kill(actor, no_restart=True)
        self._router = None
        for role, replica in everyone:
            self._replicas[role].remove(replica)
            ray.kill(replica.actor, no_restart=True)
            remove_placement_group(replica.group)
        if self._redis is not None:
            with contextlib.suppress(ray.exceptions.RayError):  # gone, its server with it
                ray.get(self._redis.stop.remote(), timeout=30)
            ray.kill(self._redis, no_restart=True)
            self._redis = None

    def _wait_for_router(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        """Until the router's registry view holds these counts and its health says
        ``SERVING`` (what ``LocalCluster.start`` waits for)."""
        assert self._router_endpoint is not None
        deadline = time.monotonic() + timeout_s
        address = self._router_endpoint.address
        key = self.spec.api_keys[0] if self.spec.api_keys else None
        seen, serving = "nothing", False
        while True:
            try:
                with _channel(address, self.certs) as channel:
                    model = (
                        generation_pb2_grpc.GenerationStub(channel)
                        .ListModels(
                            generation_pb2.ListModelsRequest(),
                            timeout=10.0,
                            metadata=auth_metadata(key),
                        )
                        .models[0]
                    )
                    health = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=10.0
                    )
                seen = f"{model.num_prefill_workers} prefill / {model.num_decode_workers} decode"
                serving = health.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as err:
                seen = f"no answer ({err.code().name})"
            if serving and seen == f"{num_prefill} prefill / {num_decode} decode":
                return
            if time.monotonic() > deadline:
                raise ComponentFailed(
                    f"the router at {address} sees {seen} workers, expected {num_prefill} / "
                    f"{num_decode}{'' if serving else ' (not SERVING)'}"
                )
            time.sleep(0.2)


CONTROLLER = ray.remote(num_cpus=0, max_concurrency=16)(Controller)


def _drain(actors: Sequence[tuple[ActorHandle, float]]) -> None:
    """``drain`` each actor at once; waits for each up to its drain timeout plus the
    grace a process gets to close, then gives up on it (the caller kills it)."""
    refs = [(actor.drain.remote(), drain_s) for actor, drain_s in actors]
    start = time.monotonic()
    for ref, drain_s in refs:
        limit = max(0.1, start + drain_s + SHUTDOWN_GRACE_S - time.monotonic())
        # dead, restarting or stuck: it is killed next either way
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(ref, timeout=limit)


def _get(ref: ray.ObjectRef) -> object:
    """``ray.get``, raising a component's own failure rather than Ray's wrapper."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, ComponentFailed):
            raise ComponentFailed(str(err.cause)) from None
        raise
    except ray.exceptions.RayActorError as err:
        raise ComponentFailed(f"an actor died while starting: {err}") from None


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _channel(address: str, certs: IssuedCerts | None) -> grpc.Channel:
    if certs is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(certs.ca.read_bytes()))
