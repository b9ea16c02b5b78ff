"""``tandem planner``: decide prefill and decode replica counts against TTFT / TPOT
targets from the components' ``/metrics``. Here it runs as a dry run (every decision
logged with its inputs, and exported on ``--metrics-port``); ``tandem serve --planner``
acts on the cluster it started. The Kubernetes and Ray actuators come with those
deployments' scaling APIs."""

from __future__ import annotations

import argparse

from tandem.cli.options import add_command, positive_int, setup_logging


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


def planner_config(args: argparse.Namespace):
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
        )
    except ValueError as err:
        args.parser.error(str(err))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    planner = add_command(
        subparsers, "planner", "decide prefill / decode replica counts (dry run)", __doc__
    )
    planner.add_argument("--router-metrics", required=True, help="the router's /metrics URL")
    planner.add_argument(
        "--prefill-metrics", action="append", default=[], help="a prefill worker's /metrics URL"
    )
    planner.add_argument(
        "--decode-metrics", action="append", default=[], help="a decode worker's /metrics URL"
    )
    planner.add_argument(
        "--metrics-port", type=int, help="serve the planner's own /metrics here (default: off)"
    )
    planner.add_argument("--host", default="127.0.0.1", help="address for --metrics-port")
    planner.add_argument("--log-level", default="INFO", help="logging threshold")
    add_planner_options(planner)
    planner.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import threading

    from tandem.cli.serve import wait_for_signal
    from tandem.common.metrics import MetricsServer
    from tandem.planner.actuators import DryRun
    from tandem.planner.loop import Endpoints, Planner

    config = planner_config(args)
    setup_logging(args.log_level)
    endpoints = Endpoints(args.router_metrics, args.prefill_metrics, args.decode_metrics)
    actuator = DryRun(len(args.prefill_metrics), len(args.decode_metrics))
    planner = Planner(config, actuator, lambda: endpoints)
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
