"""The Ray flags of ``tandem serve --ray`` (placement, resources per rank) and of the
commands that join a running cluster (``tandem scale``, ``tandem planner --actuator
ray``). Parsing imports neither Ray nor torch."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tandem.cli.options import positive_int
from tandem.ray.spec import NAMESPACE as DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from tandem.ray.spec import RankResources, RaySpec

ROLES = ("prefill", "decode")


def add_join_options(parser: argparse.ArgumentParser, default_address: str | None) -> None:
    """``--ray-address`` and ``--ray-namespace``: which Ray, which cluster on it."""
    parser.add_argument(
        "--ray-address",
        default=default_address,
        help="the Ray cluster: auto (one `ray start` began on this machine), HOST:PORT of "
        "its head's GCS, or ray://HOST:10001 (Ray Client)"
        + ("" if default_address else "; implies --ray (default: start a local Ray)"),
    )
    parser.add_argument(
        "--ray-namespace",
        default=DEFAULT_NAMESPACE,
        help="Ray namespace of the cluster's actors (one Tandem cluster per namespace)",
    )


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """``tandem serve``'s Ray group. ``--tensor-parallel-size`` works without Ray too."""
    g = parser.add_argument_group(
        "Ray and tensor parallelism",
        "With --ray every component is a Ray actor, each replica in a placement group "
        "(STRICT_PACK) with a bundle per tensor-parallel rank; Ray restarts what dies.",
    )
    g.add_argument("--ray", action="store_true", help="run the cluster on Ray")
    add_join_options(g, default_address=None)
    g.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks per prefill / decode replica (with or without Ray)",
    )
    g.add_argument(
        "--cpus-per-rank", type=_non_negative, default=1.0, help="Ray CPUs per rank (and threads)"
    )
    g.add_argument("--gpus-per-rank", type=_non_negative, default=0.0, help="Ray GPUs per rank")
    g.add_argument(
        "--kv-cache-memory-gb",
        type=_positive,
        help="each rank's KV pool; with --ray also reserved as Ray `memory` per rank "
        "(default: the engine's, unreserved)",
    )
    for role in ROLES:
        g.add_argument(
            f"--{role}-node-label",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"{role} ranks only on Ray nodes with this label (repeatable; VALUE may be "
            "!v or in(a,b))",
        )
        g.add_argument(
            f"--{role}-ray-resource",
            action="append",
            default=[],
            metavar="NAME=AMOUNT",
            help=f"a custom Ray resource each {role} rank asks for (repeatable)",
        )
    g.add_argument(
        "--ray-num-cpus",
        type=positive_int,
        help="CPUs of a local Ray started here (default: the machine's, or what the replicas "
        "reserve if more)",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    """``--ray``, or a Ray address given (which implies it)."""
    return bool(args.ray or args.ray_address)


def ray_only_flags_given(args: argparse.Namespace) -> list[str]:
    """The Ray-only flags set on a command line without ``--ray`` (a usage error)."""
    given = {
        "--cpus-per-rank": args.cpus_per_rank != 1.0,
        "--gpus-per-rank": args.gpus_per_rank != 0.0,
        "--ray-num-cpus": args.ray_num_cpus is not None,
        "--ray-namespace": args.ray_namespace != DEFAULT_NAMESPACE,
        **{f"--{r}-node-label": bool(getattr(args, f"{r}_node_label")) for r in ROLES},
        **{f"--{r}-ray-resource": bool(getattr(args, f"{r}_ray_resource")) for r in ROLES},
    }
    return [flag for flag, set_ in given.items() if set_]


def ray_spec(args: argparse.Namespace) -> RaySpec:
    """The ``RaySpec`` of a parsed ``tandem serve --ray``; a bad value raises
    ``ValueError`` naming the flag."""
    from tandem.ray.spec import RaySpec

    return RaySpec(
        address=args.ray_address,
        namespace=args.ray_namespace,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill=_rank_resources(args, "prefill"),
        decode=_rank_resources(args, "decode"),
        num_cpus=args.ray_num_cpus,
    )


def _rank_resources(args: argparse.Namespace, role: str) -> RankResources:
    from tandem.ray.spec import RankResources

    labels = _pairs(getattr(args, f"{role}_node_label"), f"--{role}-node-label", str)
    custom = _pairs(getattr(args, f"{role}_ray_resource"), f"--{role}-ray-resource", _positive)
    return RankResources(
        cpus=args.cpus_per_rank,
        gpus=args.gpus_per_rank,
        memory_gb=args.kv_cache_memory_gb,
        custom=custom,
        labels=labels,
    )


def _pairs(values: list[str], flag: str, convert) -> dict:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise ValueError(f"{flag} takes KEY=VALUE, got {value!r}")
        try:
            out[key] = convert(rest)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(f"{flag} {value!r}: {err}") from None
    return out


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
