"""``tandem planner``: decide prefill and decode replica counts against TTFT / TPOT
targets from the components' ``/metrics``, and act on them through an actuator: a dry
run (``--actuator dry-run``: every decision logged with its inputs, nothing changed), the
worker Deployments of a Helm release (``--actuator kubernetes``) or a cluster on Ray
(``--actuator ray``). Every decision is
logged and exported on ``--metrics-port``. ``tandem serve --planner`` acts on the cluster
it started."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.cli.options import add_command, positive_int, setup_logging
from tandem.cli.ray_flags import add_join_options

if TYPE_CHECKING:
    from tandem.planner.actuators import Actuator
    from tandem.planner.loop import Endpoints


def add_planner_options(parser: argparse.ArgumentParser) -> None:
    """The SLO and bounds flags, shared with ``tandem serve --planner``."""
    g = parser.add_argument_group("planner")
    g.add_argument("--ttft-p99", type=float, default=2.0, help="time-to-first-token target (s)")
    g.add_argument("--tpot-p99", type=float, default=0.1, help="time-per-output-token target (s)")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--min-{pool}", type=int, default=1, help=f"fewest {pool} replicas")
        g.add_argument(f"--max-{pool}", type=int, default=8, help=f"most {pool} replicas")
    g.add_argument("--planner-interval", type=float, default=10.0, help="seconds between decisions")
    g.add_argument(
        "--lead-time",
        type=float,
        default=120.0,
        help="forecast this far ahead (s): about the time a new replica takes to serve",
    )
    g.add_argument("--scale-up-cooldown", type=float, default=30.0, help="seconds")
    g.add_argument("--scale-down-cooldown", type=float, default=120.0, help="seconds")
    g.add_argument(
        "--down-stable",
        type=float,
        default=60.0,
        help="a lower count must be wanted this long before a replica is drained (s)",
    )
    g.add_argument("--max-step-up", type=positive_int, default=4, help="replicas added at once")
    g.add_argument(
        "--target-busy",
        type=float,
        default=0.7,
        help="plan prefill replicas to be busy this share of the time (0-1]",
    )
    g.add_argument(
        "--tolerance",
        type=float,
        default=0.2,
        help="do not grow a pool whose load needs at most this share more than it carries",
    )
    g.add_argument(
        "--surge",
        type=float,
        default=0.25,
        help="a load above the forecast by more than this share is a step: size on it at once",
    )


def planner_config(args: argparse.Namespace):
    """The ``PlannerConfig`` of the flags; impossible settings exit 2 with the reason."""
    from tandem.planner.policy import PlannerConfig, PoolBounds

    try:
        return PlannerConfig(
            ttft_p99_s=args.ttft_p99,
            tpot_p99_s=args.tpot_p99,
            prefill=PoolBounds(args.min_prefill, args.max_prefill),
            decode=PoolBounds(args.min_decode, args.max_decode),
            target_busy=args.target_busy,
            lead_s=args.lead_time,
            scale_up_cooldown_s=args.scale_up_cooldown,
            scale_down_cooldown_s=args.scale_down_cooldown,
            down_stable_s=args.down_stable,
            max_step_up=args.max_step_up,
            tolerance=args.tolerance,
            surge=args.surge,
        )
    except ValueError as err:
        args.parser.error(str(err))


@dataclass(frozen=True)
class Target:
    """What the planner acts on and reads from: an actuator and its endpoints (called
    once a round: replicas come and go)."""

    actuator: Actuator
    endpoints: Callable[[], Endpoints]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    planner = add_command(
        subparsers,
        "planner",
        "decide prefill / decode replica counts and act on them (dry run, Kubernetes, Ray)",
        __doc__,
    )
    planner.add_argument(
        "--actuator",
        choices=tuple(ACTUATORS),
        default="dry-run",
        help="dry-run: log what it would do; kubernetes: scale a Helm release's worker "
        "Deployments, finding every pod's /metrics itself; ray: scale a `tandem serve --ray` "
        "cluster through its controller, which knows every replica's /metrics",
    )
    dry = planner.add_argument_group("--actuator dry-run", "Where the metrics are.")
    dry.add_argument("--router-metrics", help="the router's /metrics URL (required)")
    dry.add_argument(
        "--prefill-metrics", action="append", default=[], help="a prefill worker's /metrics URL"
    )
    dry.add_argument(
        "--decode-metrics", action="append", default=[], help="a decode worker's /metrics URL"
    )
    kube = planner.add_argument_group(
        "--actuator kubernetes",
        "A release of deploy/helm/tandem: pods by their labels (app.kubernetes.io/instance "
        "= the release), Deployments <release>-prefill / <release>-decode.",
    )
    kube.add_argument("--release", help="the Helm release's name (required)")
    kube.add_argument(
        "--namespace",
        help="the release's namespace (default: the planner pod's own, else the kubeconfig "
        "context's, else default)",
    )
    for pool in ("prefill", "decode"):
        kube.add_argument(
            f"--{pool}-deployment",
            help=f"the {pool} Deployment's name (default: <release>-{pool}; set it when the "
            "chart's fullnameOverride renamed it)",
        )
    kube.add_argument(
        "--kubeconfig",
        type=Path,
        help="a kubeconfig file (default: the pod's service account in a cluster, else "
        "$KUBECONFIG or ~/.kube/config)",
    )
    kube.add_argument(
        "--pod-deletion-cost",
        action="store_true",
        help="before scaling a pool down, annotate its pods with the requests each holds "
        "so Kubernetes removes the least-loaded one (needs patch on pods)",
    )
    ray = planner.add_argument_group("--actuator ray", "A cluster `tandem serve --ray` started.")
    add_join_options(ray, default_address="auto")
    planner.add_argument(
        "--metrics-port", type=int, help="serve the planner's own /metrics here (default: off)"
    )
    planner.add_argument("--host", default="127.0.0.1", help="address for --metrics-port")
    planner.add_argument("--log-level", default="INFO", help="logging threshold")
    add_planner_options(planner)
    planner.set_defaults(run=_run)


def _dry_run(args: argparse.Namespace) -> Target:
    from tandem.planner.actuators import DryRun
    from tandem.planner.loop import Endpoints

    kubernetes_flags = ("release", "namespace", "prefill_deployment", "decode_deployment")
    _refuse(args, "dry-run", (*kubernetes_flags, "kubeconfig", "pod_deletion_cost"))
    if not args.router_metrics:
        args.parser.error("--actuator dry-run needs --router-metrics URL")
    endpoints = Endpoints(args.router_metrics, args.prefill_metrics, args.decode_metrics)
    actuator = DryRun(len(args.prefill_metrics), len(args.decode_metrics))
    return Target(actuator, lambda: endpoints)


def _kubernetes(args: argparse.Namespace) -> Target:
    _refuse(args, "kubernetes", ("router_metrics", "prefill_metrics", "decode_metrics"))
    if not args.release:
        args.parser.error("--actuator kubernetes needs --release NAME")
    try:
        from tandem.planner import kubernetes as k8s
    except ImportError as err:  # the client is an extra
        raise SystemExit(
            f"tandem planner: error: --actuator kubernetes needs the kubernetes client "
            f"(pip install 'tandem[kubernetes]'): {err}"
        ) from None
    namespace = args.namespace or k8s.default_namespace(args.kubeconfig)
    release = k8s.Release.of(
        namespace, args.release, args.prefill_deployment, args.decode_deployment
    )
    api = k8s.api_client(args.kubeconfig)
    actuator = k8s.KubernetesActuator(api, release, deletion_cost=args.pod_deletion_cost)
    counts = actuator.check_access()  # a missing permission fails now, in one line
    for pool, count in counts.items():
        print(
            f"planner: {pool} pool = Deployment {namespace}/{release.deployment(pool)}, "
            f"replicas: {count}",
            flush=True,
        )
    return Target(actuator, k8s.PodEndpoints(api, release))


def _ray(args: argparse.Namespace) -> Target:
    from tandem.ray import require_ray

    require_ray("tandem planner --actuator ray")
    from tandem.planner.actuators import ClusterActuator
    from tandem.ray.cluster import RayCluster

    kubernetes_flags = ("release", "namespace", "prefill_deployment", "decode_deployment")
    dry_run_flags = ("router_metrics", "prefill_metrics", "decode_metrics")
    _refuse(args, "ray", (*kubernetes_flags, *dry_run_flags, "kubeconfig", "pod_deletion_cost"))
    cluster = RayCluster.attach(args.ray_address, args.ray_namespace)
    for pool in ("prefill", "decode"):
        workers = cluster.workers(pool)
        print(f"planner: {pool} pool = {len(workers)} replicas on Ray ({', '.join(workers)})")
    return Target(ClusterActuator(cluster), cluster.planner_endpoints)


ACTUATORS: dict[str, Callable[[argparse.Namespace], Target]] = {
    "dry-run": _dry_run,
    "kubernetes": _kubernetes,
    "ray": _ray,
}
"""``--actuator`` choices: each builds its ``Target`` from the parsed flags (a usage
error exits 2) and refuses the flags of the others."""


def _refuse(args: argparse.Namespace, actuator: str, dests: tuple[str, ...]) -> None:
    given = [d for d in dests if getattr(args, d)]
    if given:
        flags = ", ".join("--" + d.replace("_", "-") for d in given)
        args.parser.error(f"{flags}: not with --actuator {actuator}")


def _run(args: argparse.Namespace) -> int:
    import threading

    from tandem.cli.serve import wait_for_signal
    from tandem.common.metrics import MetricsServer
    from tandem.planner.loop import Planner

    config = planner_config(args)
    setup_logging(args.log_level)
    target = ACTUATORS[args.actuator](args)
    planner = Planner(config, target.actuator, target.endpoints)
    server = None
    if args.metrics_port is not None:
        server = MetricsServer(planner.metrics.registry, args.host, args.metrics_port)
        print(f"planner metrics at http://{args.host}:{server.port}/metrics", flush=True)
    stop = threading.Event()
    loop = threading.Thread(target=planner.run, args=(args.planner_interval, stop), daemon=True)
    loop.start()
    wait_for_signal()
    stop.set()
    loop.join(timeout=30)
    if server is not None:
        server.close()
    return 0
