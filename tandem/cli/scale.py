"""``tandem scale``: set how many prefill or decode replicas a cluster on Ray runs.

For clusters started by ``tandem serve --ray``. New replicas serve before it returns; retired ones
drain first: they leave the registry, hand their streams to a peer with their KV,
and only then are removed, so no request is lost."""

from __future__ import annotations

import argparse

from tandem.cli.options import add_command
from tandem.cli.ray_flags import ROLES, add_join_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    scale = add_command(
        subparsers,
        "scale",
        "add or drain prefill / decode replicas of a cluster on Ray",
        __doc__.splitlines()[0],
    )
    scale.add_argument("--role", required=True, choices=ROLES, help="which pool")
    scale.add_argument("--replicas", required=True, type=int, help="replicas wanted (>= 0)")
    add_join_options(scale, default_address="auto")
    scale.add_argument(
        "--timeout", type=float, default=300.0, help="seconds new replicas may take to serve"
    )
    scale.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tandem.ray import require_ray

    require_ray("tandem scale")
    from tandem.ray.cluster import RayCluster

    if args.replicas < 0:
        args.parser.error(f"--replicas must be >= 0, got {args.replicas}")
    cluster = RayCluster.attach(args.ray_address, args.ray_namespace)
    before = cluster.workers(args.role)
    print(f"{args.role}: {len(before)} -> {args.replicas} replicas", flush=True)
    cluster.scale(args.role, args.replicas, args.timeout)
    print(f"{args.role}: {', '.join(cluster.workers(args.role)) or 'none'}")
    return 0
