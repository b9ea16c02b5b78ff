"""Tandem on Ray (``tandem serve --ray``): the router, the embedded Redis and every
prefill and decode replica run as Ray actors of one controller, each replica in a
placement group with a bundle per tensor-parallel rank. See ``docs/ray.md``.

Named actors in the cluster's namespace (``tandem`` by default): ``tandem-controller``,
``tandem-router``, ``tandem-redis``, ``tandem-prefill-0``, ``tandem-decode-0``, ...;
placement groups carry the replicas' names.

This package imports Ray only in ``tandem.ray.cluster`` (the driver's side) and the
actor modules, so the CLI can parse Ray flags without it.
"""

from tandem.ray.spec import NAMESPACE, RankResources, RaySpec

__all__ = ["NAMESPACE", "RankResources", "RaySpec"]
