"""Tandem on Ray (``tandem serve --ray``): the router, the embedded Redis and every
prefill and decode replica run as Ray actors of one controller, each replica in a
placement group with a bundle per tensor-parallel rank. See ``docs/ray.md``.

Named actors in the cluster's namespace (``tandem`` by default): ``tandem-controller``,
``tandem-router``, ``tandem-redis``, ``tandem-prefill-0``, ``tandem-decode-0``, ...;
placement groups carry the replicas' names.

This package imports Ray only in ``tandem.ray.cluster`` (the driver's side) and the
actor modules, so the CLI can parse Ray flags without it.
"""

import importlib.util

from tandem.ray.spec import NAMESPACE, RankResources, RaySpec

__all__ = ["NAMESPACE", "RankResources", "RaySpec", "require_ray"]


def require_ray(command: str) -> None:
    """Exits with one line naming the extra when Ray is not installed (it is optional:
    ``pip install 'tandem[ray]'``); ``command`` is what the user ran."""
    try:
        found = importlib.util.find_spec("ray") is not None
        if found:
            import ray  # noqa: F401 - a broken install fails here, not mid-launch
    except ImportError:
        found = False
    if not found:
        raise SystemExit(
            f"{command}: error: Ray is not installed; it is optional: pip install 'tandem[ray]'"
        )
