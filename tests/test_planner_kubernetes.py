"""The planner's Kubernetes actuator and endpoint discovery, with the real ``kubernetes``
client against a small fake API server on 127.0.0.1 that answers the few paths they use
with objects serialized from the client's own models (``V1Scale``, ``V1PodList``,
``V1Status``) and records every request: what a PATCH changes (path, content type, body),
the counts read, RBAC and missing-object errors, only Ready pods found, the least-loaded
pod marked for removal, a kubeconfig's server and token used, and the planner loop and
``tandem planner --actuator kubernetes`` scaling a Deployment end to end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
from kubernetes import client  # noqa: E402

from tandem.planner.kubernetes import (  # noqa: E402
    DELETION_COST,
    Forbidden,
    KubernetesActuator,
    NoRouter,
    NotFound,
    PodEndpoints,
    Release,
    access,
    api_client,
    default_namespace,
)
from tandem.planner.loop import Endpoints, Planner  # noqa: E402
from tandem.planner.policy import PlannerConfig, PoolBounds  # noqa: E402

pytestmark = pytest.mark.timeout(120)

NS = "prod"
RELEASE = Release.of(NS, "rel")
SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
POD_LIST = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    authorization: str | None
    body: object


@dataclass
class FakeApi:
    """The API paths the actuator and discovery use, over an in-memory namespace.
    ``forbidden``: (method, resource) pairs answered 403, as RBAC would."""

    deployments: dict[str, int] = field(default_factory=dict)
    pods: list[client.V1Pod] = field(default_factory=list)
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def patches(self, resource: str, dry_run: bool = False) -> list[Request]:
        kind = SCALE if resource == "deployments/scale" else POD
        return [
            r
            for r in self.requests
            if r.method == "PATCH"
            and kind.match(r.path)
            and (r.query.get("dryRun") == ["All"]) == dry_run
        ]

    def answer(self, request: Request) -> tuple[int, object]:
        if m := SCALE.match(request.path):
            return self._scale(request, m.group(1), m.group(2))
        if m := POD_LIST.match(request.path):
            if ("GET", "pods") in self.forbidden:
                return _status(403, "Forbidden", 'pods is forbidden: cannot list resource "pods"')
            selector = dict(kv.split("=", 1) for kv in request.query["labelSelector"][0].split(","))
            items = [
                p
                for p in self.pods
                if m.group(1) == NS and selector.items() <= (p.metadata.labels or {}).items()
            ]
            return 200, client.V1PodList(api_version="v1", kind="PodList", items=items)
        if m := POD.match(request.path):
            if ("PATCH", "pods") in self.forbidden:
                return _status(403, "Forbidden", 'cannot patch resource "pods"')
            pod = next((p for p in self.pods if p.metadata.name == m.group(2)), None)
            if pod is None:
                return _status(404, "NotFound", f'pods "{m.group(2)}" not found')
            if request.query.get("dryRun") != ["All"]:
                notes = request.body["metadata"]["annotations"]
                pod.metadata.annotations = {**(pod.metadata.annotations or {}), **notes}
            return 200, pod
        return _status(404, "NotFound", "no such path")

    def _scale(self, request: Request, namespace: str, name: str) -> tuple[int, object]:
        if (request.method, "deployments/scale") in self.forbidden:
            verb = "get" if request.method == "GET" else "patch"
            return _status(403, "Forbidden", f'cannot {verb} resource "deployments/scale"')
        if namespace != NS or name not in self.deployments:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "PATCH" and request.query.get("dryRun") != ["All"]:
            self.deployments[name] = request.body["spec"]["replicas"]
        replicas = self.deployments[name]
        return 200, client.V1Scale(
            api_version="autoscaling/v1",
            kind="Scale",
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            spec=client.V1ScaleSpec(replicas=replicas),
            status=client.V1ScaleStatus(replicas=replicas, selector="app=x"),
        )


def _status(code: int, reason: str, message: str) -> tuple[int, client.V1Status]:
    status = client.V1Status(
        api_version="v1", kind="Status", status="Failure", reason=reason, message=message
    )
    status.code = code
    return code, status


class _Server(ThreadingHTTPServer):
    daemon_threads = True


Respond = Callable[[str, str, dict[str, str], bytes], tuple[int, str, bytes]]


@contextlib.contextmanager
def serving(respond: Respond) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 (a free port) answering GET and PATCH with
    ``respond(method, path, headers, body) -> (status, content type, body)`` (header
    names lower-cased), on a
    daemon thread; its URL while the block runs."""

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a stuck client cannot hold a thread for longer

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, content_type, payload = respond(
                self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
            )
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_PATCH = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def api_respond(fake: FakeApi) -> Respond:
    serialize = client.ApiClient().sanitize_for_serialization

    def respond(method: str, path: str, headers: dict[str, str], body: bytes):
        url = urlsplit(path)
        request = Request(
            method,
            url.path,
            parse_qs(url.query),
            headers.get("content-type"),
            headers.get("authorization"),
            json.loads(body) if body else None,
        )
        fake.requests.append(request)
        code, answer = fake.answer(request)
        return code, "application/json", json.dumps(serialize(answer)).encode()

    return respond


@pytest.fixture
def fake() -> Iterator[FakeApi]:
    fake = FakeApi(deployments={"rel-prefill": 1, "rel-decode": 3})
    with serving(api_respond(fake)) as url:
        fake.url = url
        yield fake


def api_of(fake: FakeApi) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=fake.url))


def pod(
    name: str,
    component: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    metrics_port: int | None = 9400,
    deleting: bool = False,
    release: str = "rel",
) -> client.V1Pod:
    """A pod of the chart: its labels, a container with the chart's named ports."""
    ports = [client.V1ContainerPort(name="grpc", container_port=50061)]
    if metrics_port is not None:
        ports.append(client.V1ContainerPort(name="metrics", container_port=metrics_port))
    labels = {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": release,
        "app.kubernetes.io/component": component,
    }
    condition = client.V1PodCondition(type="Ready", status="True" if ready else "False")
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=NS,
            labels=labels,
            deletion_timestamp=datetime.now(UTC) if deleting else None,
        ),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name=component, image="tandem", ports=ports)]
        ),
        status=client.V1PodStatus(
            phase="Running" if ip else "Pending", pod_ip=ip, conditions=[condition]
        ),
    )


# --- the actuator -------------------------------------------------------------------------


def test_the_counts_are_the_deployments_scale(fake: FakeApi) -> None:
    actuator = KubernetesActuator(api_of(fake), RELEASE)
    assert actuator.replicas("prefill") == 1
    assert actuator.replicas("decode") == 3
    assert [(r.method, r.path) for r in fake.requests] == [
        ("GET", "/apis/apps/v1/namespaces/prod/deployments/rel-prefill/scale"),
        ("GET", "/apis/apps/v1/namespaces/prod/deployments/rel-decode/scale"),
    ]


def test_scaling_patches_spec_replicas_of_one_deployment_and_nothing_else(
    fake: FakeApi,
) -> None:
    actuator = KubernetesActuator(api_of(fake), RELEASE)
    actuator.scale("decode", 5)
    (patch,) = fake.patches("deployments/scale")
    assert patch.path == "/apis/apps/v1/namespaces/prod/deployments/rel-decode/scale"
    # A merge patch: the body is the whole change. (The client's default for a PATCH
    # would be a JSON patch, which the API server refuses for a dict body.)
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"spec": {"replicas": 5}}
    assert "dryRun" not in patch.query
    assert fake.deployments == {"rel-prefill": 1, "rel-decode": 5}
    assert actuator.replicas("decode") == 5
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        actuator.scale("decode", -1)
    with pytest.raises(ValueError, match="pool must be one of"):
        actuator.scale("router", 2)
    assert len(fake.patches("deployments/scale")) == 1


def test_fullname_override_names_the_deployments(fake: FakeApi) -> None:
    fake.deployments = {"tandem-prefill": 2, "tandem-decode": 1}
    release = Release.of(NS, "rel", prefill="tandem-prefill", decode="tandem-decode")
    KubernetesActuator(api_of(fake), release).scale("prefill", 3)
    assert fake.deployments == {"tandem-prefill": 3, "tandem-decode": 1}


def test_the_start_up_check_is_a_dry_run(fake: FakeApi) -> None:
    counts = KubernetesActuator(api_of(fake), RELEASE).check_access()
    assert counts == {"prefill": 1, "decode": 3}
    dry = fake.patches("deployments/scale", dry_run=True)
    assert [p.body for p in dry] == [{"spec": {"replicas": 1}}, {"spec": {"replicas": 3}}]
    assert fake.patches("deployments/scale") == []
    assert fake.deployments == {"rel-prefill": 1, "rel-decode": 3}


@pytest.mark.parametrize(
    ("refused", "call", "words"),
    [
        (
            ("PATCH", "deployments/scale"),
            lambda a: a.scale("decode", 4),
            "may not patch deployments/scale 'rel-decode' in namespace 'prod'",
        ),
        (
            ("PATCH", "deployments/scale"),
            lambda a: a.check_access(),  # found at start-up, before any change
            "may not patch deployments/scale 'rel-prefill' in namespace 'prod'",
        ),
        (
            ("GET", "deployments/scale"),
            lambda a: a.replicas("prefill"),
            "may not get deployments/scale 'rel-prefill' in namespace 'prod'",
        ),
    ],
)
def test_a_missing_rbac_permission_is_named(
    fake: FakeApi, refused: tuple[str, str], call: Callable, words: str
) -> None:
    fake.forbidden = {refused}
    with pytest.raises(Forbidden) as caught:
        call(KubernetesActuator(api_of(fake), RELEASE))
    assert words in str(caught.value)
    verb = refused[0].lower()  # GET is get, PATCH is patch
    assert f"verbs: [{verb}], resourceNames: [rel-" in str(caught.value)  # the rule to add
    assert caught.value.status == 403 and caught.value.access.resource == "deployments/scale"
    assert fake.deployments == {"rel-prefill": 1, "rel-decode": 3}


def test_listing_pods_without_permission_is_named(fake: FakeApi) -> None:
    fake.forbidden = {("GET", "pods")}
    with pytest.raises(Forbidden, match="may not list pods in namespace 'prod'"):
        PodEndpoints(api_of(fake), RELEASE)()


def test_a_missing_deployment_is_named(fake: FakeApi) -> None:
    release = Release.of(NS, "rel", decode="rel-decoder")
    actuator = KubernetesActuator(api_of(fake), release)
    with pytest.raises(NotFound) as caught:
        actuator.scale("decode", 2)
    message = str(caught.value)
    assert "Deployment 'rel-decoder' not found in namespace 'prod'" in message
    assert caught.value.status == 404
    assert actuator.replicas("prefill") == 1  # the other pool is unaffected


def test_an_unreachable_api_server_is_one_error() -> None:
    from tandem.planner.kubernetes import KubernetesError

    with serving(lambda *_: (200, "text/plain", b"")) as url:
        pass  # the port is closed again: nothing listens there
    api = client.ApiClient(client.Configuration(host=url))
    api.configuration.retries = 0
    with pytest.raises(KubernetesError, match="cannot reach the Kubernetes API to get"):
        KubernetesActuator(api, RELEASE, timeout_s=2).replicas("decode")


def test_the_permissions_listed_are_the_ones_used() -> None:
    rules = {(a.verb, a.resource, a.group, a.name) for a in access(RELEASE)}
    assert rules == {
        ("get", "deployments/scale", "apps", "rel-prefill"),
        ("patch", "deployments/scale", "apps", "rel-prefill"),
        ("get", "deployments/scale", "apps", "rel-decode"),
        ("patch", "deployments/scale", "apps", "rel-decode"),
        ("list", "pods", "", None),
    }
    with_cost = {(a.verb, a.resource) for a in access(RELEASE, deletion_cost=True)}
    assert with_cost - {(v, r) for v, r, _, _ in rules} == {("patch", "pods")}


# --- endpoint discovery -------------------------------------------------------------------


def test_discovery_finds_the_ready_pods_of_this_release_only(fake: FakeApi) -> None:
    fake.pods = [
        pod("rel-router-b", "router", "10.0.0.2"),
        pod("rel-router-a", "router", "10.0.0.1"),
        pod("rel-router-c", "router", "10.0.0.3", ready=False),
        pod("rel-prefill-0", "prefill", "10.0.1.1"),
        pod("rel-prefill-1", "prefill", None, ready=False),  # pending: no IP yet
        pod("rel-decode-0", "decode", "10.0.2.1", deleting=True),  # draining away
        pod("rel-decode-1", "decode", "10.0.2.2", metrics_port=9500),
        pod("rel-decode-2", "decode", "fd00::7"),
        pod("rel-decode-3", "decode", "10.0.2.4", metrics_port=None),
        pod("other-decode-0", "decode", "10.0.9.9", release="other"),
    ]
    endpoints = PodEndpoints(api_of(fake), RELEASE)()
    assert endpoints == Endpoints(
        "http://10.0.0.1:9400/metrics",
        ["http://10.0.1.1:9400/metrics"],
        ["http://10.0.2.2:9500/metrics", "http://[fd00::7]:9400/metrics"],
        ["http://10.0.0.2:9400/metrics"],
    )
    selectors = [r.query["labelSelector"][0] for r in fake.requests]
    assert selectors == [
        f"app.kubernetes.io/name=tandem,app.kubernetes.io/instance=rel,"
        f"app.kubernetes.io/component={c}"
        for c in ("router", "prefill", "decode")
    ]


def test_discovery_without_a_ready_router_says_so(fake: FakeApi) -> None:
    fake.pods = [pod("rel-router-a", "router", ready=False), pod("rel-decode-0", "decode")]
    with pytest.raises(NoRouter, match="no Ready router pod in namespace 'prod'"):
        PodEndpoints(api_of(fake), RELEASE)()


# --- scale-down picks the least-loaded pod --------------------------------------------------


def metrics_text(running: int = 0, waiting: int = 0) -> str:
    return f"tandem:num_requests_running {running}\ntandem:num_requests_waiting {waiting}\n"


def worker_metrics(text: Callable[[], str]) -> contextlib.AbstractContextManager[str]:
    return serving(lambda *_: (200, "text/plain", text().encode()))


def test_scale_down_marks_each_pod_with_the_requests_it_holds(fake: FakeApi) -> None:
    loads = {"rel-decode-0": (4, 1), "rel-decode-1": (0, 0), "rel-decode-2": (2, 0)}
    with contextlib.ExitStack() as stack:
        for name, (running, waiting) in loads.items():
            url = stack.enter_context(
                worker_metrics(lambda r=running, w=waiting: metrics_text(r, w))
            )
            port = int(url.rsplit(":", 1)[1])
            fake.pods.append(pod(name, "decode", "127.0.0.1", metrics_port=port))
        fake.pods.append(pod("rel-decode-3", "decode", "127.0.0.1", ready=False))
        actuator = KubernetesActuator(api_of(fake), RELEASE, deletion_cost=True)
        actuator.scale("decode", 2)
    costs = {p.path.rsplit("/", 1)[1]: p for p in fake.patches("pods")}
    assert {name: p.body for name, p in costs.items()} == {
        "rel-decode-0": {"metadata": {"annotations": {DELETION_COST: "5"}}},
        "rel-decode-1": {"metadata": {"annotations": {DELETION_COST: "0"}}},
        "rel-decode-2": {"metadata": {"annotations": {DELETION_COST: "2"}}},
    }
    assert {p.content_type for p in costs.values()} == {"application/merge-patch+json"}
    # The marks go first, then the count.
    kinds = [
        ("scale" if SCALE.match(r.path) else "pod") for r in fake.requests if r.method == "PATCH"
    ]
    assert kinds == ["pod", "pod", "pod", "scale"]
    assert fake.deployments["rel-decode"] == 2


def test_scale_up_marks_nothing(fake: FakeApi) -> None:
    fake.pods = [pod("rel-decode-0", "decode")]
    KubernetesActuator(api_of(fake), RELEASE, deletion_cost=True).scale("decode", 4)
    assert fake.patches("pods") == []
    KubernetesActuator(api_of(fake), RELEASE).scale("decode", 1)  # off: never marks
    assert fake.patches("pods") == []


def test_marking_without_patch_permission_fails_before_the_count_changes(
    fake: FakeApi,
) -> None:
    fake.pods = [pod("rel-decode-0", "decode")]
    fake.forbidden = {("PATCH", "pods")}
    actuator = KubernetesActuator(api_of(fake), RELEASE, deletion_cost=True)
    with pytest.raises(Forbidden, match="may not patch pods 'rel-decode-0'"):
        actuator.check_access()
    with pytest.raises(Forbidden):
        actuator.scale("decode", 1)
    assert fake.deployments["rel-decode"] == 3


# --- configuration --------------------------------------------------------------------------


def kubeconfig(tmp_path: Path, server: str, token: str = "s3cret") -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": NS}}
                ],
                "current-context": "x",
            }
        )
    )
    return path


def test_a_kubeconfig_gives_the_server_the_token_and_the_namespace(
    fake: FakeApi, tmp_path: Path
) -> None:
    config = kubeconfig(tmp_path, fake.url)
    assert KubernetesActuator(api_client(config), RELEASE).replicas("decode") == 3
    assert fake.requests[-1].authorization == "Bearer s3cret"
    assert default_namespace(config) == NS
    assert default_namespace(tmp_path / "missing") == "default"


def test_no_configuration_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    from tandem.cli.options import CommandError

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CommandError, match="no usable Kubernetes configuration"):
        api_client(tmp_path / "missing")


# --- the planner on top ---------------------------------------------------------------------


class LiveRouter:
    """A router's /metrics whose counters grow with every scrape: each scrape, 10 more
    requests, each with a time per output token of about 0.3 s (a broken 0.1 s target)."""

    def __init__(self) -> None:
        self.scrapes = 0

    def __call__(self) -> str:
        self.scrapes += 1
        n = 10 * self.scrapes
        family = "tandem:time_per_output_token_seconds_bucket"
        return "".join(
            [
                f"tandem:request_prompt_tokens_count {n}\n",
                f'{family}{{le="0.1"}} 0\n',
                f'{family}{{le="0.5"}} {n}\n',
                f'{family}{{le="+Inf"}} {n}\n',
            ]
        )


@contextlib.contextmanager
def release_pods(fake: FakeApi, routers: int) -> Iterator[None]:
    """Ready router pods and one Ready pod per pool, each /metrics served here."""
    with contextlib.ExitStack() as stack:
        for i in range(routers):
            url = stack.enter_context(worker_metrics(LiveRouter()))
            fake.pods.append(pod(f"rel-router-{i}", "router", "127.0.0.1", metrics_port=_port(url)))
        for component in ("prefill", "decode"):
            url = stack.enter_context(worker_metrics(metrics_text))  # idle: nothing to calibrate on
            fake.pods.append(
                pod(f"rel-{component}-0", component, "127.0.0.1", metrics_port=_port(url))
            )
        yield


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_planner_reads_every_router_pod_and_scales_the_deployment(
    fake: FakeApi, caplog: pytest.LogCaptureFixture
) -> None:
    fake.deployments = {"rel-prefill": 1, "rel-decode": 1}
    config = PlannerConfig(
        tpot_p99_s=0.1, decode=PoolBounds(1, 4), prefill=PoolBounds(1, 1), scale_up_cooldown_s=0
    )
    api, clock = api_of(fake), Clock()
    with release_pods(fake, routers=2):
        planner = Planner(
            config, KubernetesActuator(api, RELEASE), PodEndpoints(api, RELEASE), clock=clock
        )
        assert planner.tick() == []
        clock.now += 10
        with caplog.at_level("INFO", logger="tandem.planner"):
            decisions = {d.pool: d for d in planner.tick()}
    # Two routers, 10 requests each in 10 s: 2 requests/s in all.
    assert planner.last_signals is not None and planner.last_signals.request_rate == 2.0
    assert decisions["decode"].estimate.slo_broken and decisions["decode"].target == 2
    assert decisions["prefill"].target == 1
    assert fake.deployments == {"rel-prefill": 1, "rel-decode": 2}
    (patch,) = fake.patches("deployments/scale")
    assert patch.body == {"spec": {"replicas": 2}}
    assert any("decode: 1 -> 2 (wanted 2; slo)" in r.getMessage() for r in caplog.records)


def test_tandem_planner_acts_on_a_release(fake: FakeApi, tmp_path: Path) -> None:
    fake.deployments = {"rel-prefill": 1, "rel-decode": 1}
    config = kubeconfig(tmp_path, fake.url)
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    with release_pods(fake, routers=1):
        command = [
            sys.executable, "-m", "tandem.cli", "planner", "--actuator", "kubernetes",
            "--kubeconfig", str(config), "--release", "rel", "--tpot-p99", "0.1",
            "--max-prefill", "1", "--planner-interval", "0.3", "--scale-up-cooldown", "0",
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        try:
            deadline = time.monotonic() + 60
            while fake.deployments["rel-decode"] == 1 and time.monotonic() < deadline:
                assert process.poll() is None, process.stdout.read()
                time.sleep(0.1)
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
    assert fake.deployments["rel-decode"] == 2, output
    assert process.returncode == 0, output
    # The namespace comes from the kubeconfig's context.
    assert "decode pool = Deployment prod/rel-decode, replicas: 1" in output
    assert "decode: 1 -> 2" in output
    # The start-up check ran first, as a dry run.
    first_patch = next(r for r in fake.requests if r.method == "PATCH")
    assert first_patch.query.get("dryRun") == ["All"]


def test_tandem_planner_names_a_missing_permission_at_start(fake: FakeApi, tmp_path: Path) -> None:
    fake.forbidden = {("PATCH", "deployments/scale")}
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    done = subprocess.run(
        [
            sys.executable, "-m", "tandem.cli", "planner", "--actuator", "kubernetes",
            "--kubeconfig", str(kubeconfig(tmp_path, fake.url)), "--release", "rel",
        ],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("tandem planner: error: forbidden: the planner's ServiceAccount")
    assert "may not patch deployments/scale 'rel-prefill' in namespace 'prod'" in done.stderr
    assert fake.deployments == {"rel-prefill": 1, "rel-decode": 3}
