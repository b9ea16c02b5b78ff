"""The planner on Kubernetes (the chart's plain-Deployment mode): ``KubernetesActuator``
reads and sets the prefill and decode worker Deployments' replica counts through their
``scale`` subresource, and ``PodEndpoints`` finds the ``/metrics`` URL of every Ready
router and worker pod of a Helm release by the chart's labels. Both use the official
``kubernetes`` client (the ``kubernetes`` extra) with an ``ApiClient`` from
``api_client``: the pod's service account in a cluster, else a kubeconfig.

Scaling down is a drain, and nothing here has to do it: the ReplicaSet controller deletes
a pod, its containers get SIGTERM after the chart's ``preStop`` delay, and a worker's
SIGTERM path leaves the registry, finishes or hands over its streams within
``--drain-timeout``, then exits (the chart sizes ``terminationGracePeriodSeconds`` for
it). With ``deletion_cost`` the actuator first marks each Ready pod of the pool with the
requests it holds (annotation ``controller.kubernetes.io/pod-deletion-cost``), so the
ReplicaSet controller removes the least-loaded one. That is best effort: the controller
may act on the new count before it sees the annotations.

What the planner's ServiceAccount needs (``access``; the chart's planner Role grants
exactly that): ``get`` and ``patch`` on ``deployments/scale`` (API group ``apps``) of
the two worker Deployments by name, and ``list`` on ``pods``; ``patch`` on ``pods`` too
with ``deletion_cost``. A missing one fails with a ``Forbidden`` naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.cli.options import CommandError
from tandem.common.metrics import Scrape
from tandem.planner.actuators import POOLS
from tandem.planner.loop import Endpoints

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, V1Pod
    from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"
"""``{"spec": {"replicas": n}}`` changes that one field and nothing else."""
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Release:
    """A Helm release of Tandem's chart: ``namespace``, ``name`` (its pods' label
    ``app.kubernetes.io/instance``) and its worker Deployments' names."""

    namespace: str
    name: str
    prefill_deployment: str
    decode_deployment: str

    @classmethod
    def of(
        cls, namespace: str, name: str, prefill: str | None = None, decode: str | None = None
    ) -> Release:
        """The chart names the Deployments ``<release>-prefill`` and ``<release>-decode``
        (``fullnameOverride`` replaces the release name: pass them then)."""
        return cls(namespace, name, prefill or f"{name}-prefill", decode or f"{name}-decode")

    def deployment(self, pool: str) -> str:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        return self.prefill_deployment if pool == "prefill" else self.decode_deployment

    def selector(self, component: str) -> str:
        """The label selector of this release's ``router``, ``prefill`` or ``decode`` pods."""
        return f"{NAME_LABEL}=tandem,{INSTANCE_LABEL}={self.name},{COMPONENT_LABEL}={component}"


@dataclass(frozen=True)
class Access:
    """One permission on the Kubernetes API: ``verb`` on ``resource`` in API ``group``
    (``""``: the core group), on the object ``name`` (``None``: any) in ``namespace``."""

    verb: str
    resource: str
    namespace: str
    group: str = ""
    name: str | None = None

    def __str__(self) -> str:
        target = f"{self.resource} {self.name!r}" if self.name else self.resource
        return f"{self.verb} {target} in namespace {self.namespace!r}"

    @property
    def rule(self) -> str:
        """The Role rule that grants it."""
        names = f", resourceNames: [{self.name}]" if self.name else ""
        return (
            f'apiGroups: ["{self.group}"], resources: [{self.resource}], '
            f"verbs: [{self.verb}]{names}"
        )


def access(release: Release, deletion_cost: bool = False) -> list[Access]:
    """Every permission the actuator and the endpoint discovery use for ``release``."""
    ns = release.namespace
    needed = [
        Access(verb, "deployments/scale", ns, "apps", release.deployment(pool))
        for pool in POOLS
        for verb in ("get", "patch")
    ]
    needed.append(Access("list", "pods", ns))
    if deletion_cost:
        needed.append(Access("patch", "pods", ns))
    return needed


class KubernetesError(CommandError):
    """A Kubernetes API call failed. ``access``: what the call needed; ``status``: the
    HTTP status, ``None`` when the API server was not reached."""

    def __init__(self, message: str, access: Access, status: int | None) -> None:
        super().__init__(message)
        self.access = access
        self.status = status


class Forbidden(KubernetesError):
    """HTTP 403: the ServiceAccount lacks ``access`` (RBAC)."""


class NotFound(KubernetesError):
    """HTTP 404: the object ``access`` names does not exist."""


class NoRouter(CommandError):
    """No Ready router pod of the release: the planner has nothing to read load from."""


class KubernetesActuator:
    """The ``Actuator`` of a release's worker Deployments, through their ``scale``
    subresource.

    ``replicas`` is the count asked for (``spec.replicas``), not the pods running now:
    a pod still loading its model counts, so the planner does not ask for it twice.
    ``scale`` sends a merge patch of ``spec.replicas`` alone. Every call waits at most
    ``timeout_s``; a failure raises a ``KubernetesError`` naming the Deployment and the
    permission (``Forbidden``) or the object (``NotFound``) at fault."""

    def __init__(
        self,
        api: ApiClient,
        release: Release,
        *,
        deletion_cost: bool = False,
        timeout_s: float = 10.0,
    ) -> None:
        from kubernetes.client import AppsV1Api

        self.release = release
        self.deletion_cost = deletion_cost
        self.timeout_s = timeout_s
        self._apps = AppsV1Api(api)
        self._pods = Pods(api, release, timeout_s)

    def replicas(self, pool: str) -> int:
        name = self.release.deployment(pool)
        with _calling(Access("get", "deployments/scale", self.release.namespace, "apps", name)):
            scale = self._apps.read_namespaced_deployment_scale(
                name, self.release.namespace, _request_timeout=self.timeout_s
            )
        return (scale.spec.replicas if scale.spec else None) or 0

    def scale(self, pool: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        current = self.replicas(pool)
        if self.deletion_cost and replicas < current:
            self._mark_deletion_costs(pool)
        log.info(
            "kubernetes: Deployment %s/%s replicas %d -> %d",
            self.release.namespace, self.release.deployment(pool), current, replicas,
        )  # fmt: skip
        self._patch(pool, replicas, dry_run=False)

    def check_access(self) -> dict[str, int]:
        """Each pool's count, after patching both Deployments with their own counts as a
        server-side dry run (nothing changes): a missing permission fails here, at
        start-up, not at the first change. With ``deletion_cost``, the same for one
        worker pod's annotations (when any runs)."""
        counts = {pool: self.replicas(pool) for pool in POOLS}
        for pool, count in counts.items():
            self._patch(pool, count, dry_run=True)
        if self.deletion_cost:
            pods = [p for pool in POOLS for p in self._pods.ready(pool)]
            if pods:
                self._pods.annotate(pods[0].name, {}, dry_run=True)
        return counts

    def _patch(self, pool: str, replicas: int, dry_run: bool) -> None:
        name = self.release.deployment(pool)
        with _calling(Access("patch", "deployments/scale", self.release.namespace, "apps", name)):
            self._apps.patch_namespaced_deployment_scale(
                name,
                self.release.namespace,
                {"spec": {"replicas": replicas}},
                dry_run="All" if dry_run else None,
                _content_type=MERGE_PATCH,
                _request_timeout=self.timeout_s,
            )

    def _mark_deletion_costs(self, pool: str) -> None:
        """Each Ready pod's deletion cost = the requests it holds (running and waiting):
        the pod holding fewest goes first. A pod whose metrics cannot be read costs 0."""
        for pod in self._pods.ready(pool):
            cost = 0
            if pod.metrics_url is not None:
                try:
                    cost = _requests_held(Scrape.of(pod.metrics_url, timeout_s=self.timeout_s))
                except (OSError, ValueError) as err:  # unreachable, or not metrics text
                    log.debug("deletion cost of %s: scrape failed: %s", pod.name, err)
            with contextlib.suppress(NotFound):  # gone meanwhile: nothing to rank
                self._pods.annotate(pod.name, {DELETION_COST: str(cost)}, dry_run=False)


class PodEndpoints:
    """The ``endpoints`` of a ``Planner`` on Kubernetes: each call lists the release's
    Ready router, prefill and decode pods by the chart's labels and returns their
    ``/metrics`` URLs (pod IP and the container port named ``metrics``), in pod-name
    order. Every Ready router is read (their loads add up). Raises ``NoRouter`` when no
    router pod is Ready (the planner loop logs the round as failed and tries again)."""

    def __init__(self, api: ApiClient, release: Release, timeout_s: float = 10.0) -> None:
        self.release = release
        self._pods = Pods(api, release, timeout_s)

    def __call__(self) -> Endpoints:
        routers = self._urls("router")
        if not routers:
            raise NoRouter(
                f"no Ready router pod in namespace {self.release.namespace!r} with labels "
                f"{self.release.selector('router')}"
            )
        return Endpoints(routers[0], self._urls("prefill"), self._urls("decode"), routers[1:])

    def _urls(self, component: str) -> list[str]:
        return [p.metrics_url for p in self._pods.ready(component) if p.metrics_url]


@dataclass(frozen=True)
class ReadyPod:
    name: str
    metrics_url: str | None
    """``None`` when no container has a port named ``metrics``."""


class Pods:
    """The pods of one release, read through the core API."""

    def __init__(self, api: ApiClient, release: Release, timeout_s: float) -> None:
        from kubernetes.client import CoreV1Api

        self.release = release
        self.timeout_s = timeout_s
        self._core = CoreV1Api(api)

    def ready(self, component: str) -> list[ReadyPod]:
        """The release's ``component`` pods that serve: Ready, with an IP, not being
        deleted; by name."""
        with _calling(Access("list", "pods", self.release.namespace)):
            pods = self._core.list_namespaced_pod(
                self.release.namespace,
                label_selector=self.release.selector(component),
                _request_timeout=self.timeout_s,
            )
        ready = [p for p in pods.items if _serves(p)]
        return sorted(
            (ReadyPod(p.metadata.name, _metrics_url(p)) for p in ready), key=lambda p: p.name
        )

    def annotate(self, name: str, annotations: dict[str, str], dry_run: bool) -> None:
        with _calling(Access("patch", "pods", self.release.namespace, "", name)):
            self._core.patch_namespaced_pod(
                name,
                self.release.namespace,
                {"metadata": {"annotations": annotations}},
                dry_run="All" if dry_run else None,
                _content_type=MERGE_PATCH,
                _request_timeout=self.timeout_s,
            )


def _serves(pod: V1Pod) -> bool:
    status, meta = pod.status, pod.metadata
    if status is None or meta is None or meta.deletion_timestamp is not None:
        return False
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    return ready and bool(status.pod_ip)


def _metrics_url(pod: V1Pod) -> str | None:
    for container in pod.spec.containers if pod.spec else ():
        for port in container.ports or ():
            if port.name == "metrics":
                host = pod.status.pod_ip
                host = f"[{host}]" if ":" in host else host  # an IPv6 pod
                return f"http://{host}:{port.container_port}/metrics"
    return None


def _requests_held(scrape: Scrape) -> int:
    names = ("num_requests_running", "num_requests_waiting", "num_requests_waiting_for_kv")
    return round(sum(scrape.value(n) for n in names))


@contextlib.contextmanager
def _calling(needed: Access) -> Iterator[None]:
    """Turns the client's errors into ``KubernetesError``s that say what to fix."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as err:
        raise _api_error(err, needed) from None
    except HTTPError as err:
        raise KubernetesError(
            f"cannot reach the Kubernetes API to {needed}: {err}", needed, None
        ) from None


def _api_error(err: ApiException, needed: Access) -> KubernetesError:
    status = err.status
    if status == 403:
        return Forbidden(
            f"forbidden: the planner's ServiceAccount may not {needed}; grant it with a "
            f"Role rule {{{needed.rule}}} bound to that ServiceAccount (the chart's planner "
            "Role has it)",
            needed,
            status,
        )
    if status == 404:
        kind = "Deployment" if needed.resource.startswith("deployments") else "object"
        return NotFound(
            f"{kind} {needed.name!r} not found in namespace {needed.namespace!r} (is the "
            "release name or the Deployment's name wrong?)",
            needed,
            status,
        )
    return KubernetesError(
        f"the Kubernetes API refused to {needed}: {status} {err.reason}", needed, status
    )


def api_client(kubeconfig: Path | None = None) -> ApiClient:
    """A client of the Kubernetes API: with ``kubeconfig``, that file's current context;
    without, the pod's service account when this runs in a cluster, else
    ``$KUBECONFIG`` or ``~/.kube/config``. A missing or broken configuration raises a
    ``CommandError`` saying which."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(
                config_file=None if kubeconfig is None else str(kubeconfig),
                client_configuration=configuration,
            )
    except (config.ConfigException, OSError) as err:
        where = kubeconfig or os.environ.get("KUBECONFIG", "~/.kube/config")
        raise CommandError(
            f"no usable Kubernetes configuration (in-cluster or {where}): {err}"
        ) from None
    return client.ApiClient(configuration)


def default_namespace(kubeconfig: Path | None = None) -> str:
    """This pod's namespace in a cluster, else the kubeconfig's current context's, else
    ``default``."""
    if kubeconfig is None and IN_CLUSTER_NAMESPACE.exists():
        return IN_CLUSTER_NAMESPACE.read_text().strip()
    from kubernetes import config

    try:
        _, current = config.list_kube_config_contexts(
            None if kubeconfig is None else str(kubeconfig)
        )
    except (config.ConfigException, OSError):
        return "default"
    return (current or {}).get("context", {}).get("namespace") or "default"
