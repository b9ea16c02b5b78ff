"""Where the planner's decisions go. An actuator reports each pool's replica count and
sets it; scaling down must drain (the workers' own SIGTERM path does: leave the registry,
finish or hand over the streams, exit).

``DryRun`` only records; ``ClusterActuator`` scales a cluster Tandem launched, as
processes (``tandem serve``) or on Ray (``tandem serve --ray``, ``tandem planner
--actuator ray``);
``tandem.planner.kubernetes.KubernetesActuator`` patches the ``scale`` of the chart's
worker Deployments (``tandem planner --actuator kubernetes``).
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class Actuator(Protocol):
    """``replicas``: the count the pool is set to (``pool`` is one of ``POOLS``);
    ``scale``: set it, returning once the change is asked for (replicas may still be
    starting or draining)."""

    def replicas(self, pool: str) -> int: ...

    def scale(self, pool: str, replicas: int) -> None: ...


class DryRun:
    """Logs what it would do and remembers it, so the next decision builds on it."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.counts = {"prefill": prefill, "decode": decode}

    def replicas(self, pool: str) -> int:
        return self.counts[pool]

    def scale(self, pool: str, replicas: int) -> None:
        log.info("dry run: would scale %s from %d to %d", pool, self.counts[pool], replicas)
        self.counts[pool] = replicas


class ScalableCluster(Protocol):
    """A cluster Tandem launched: ``tandem.cli.launcher.LocalCluster`` (processes) or
    ``tandem.ray.cluster.RayCluster`` (Ray actors). ``scale`` adds replicas that serve
    before it returns, or drains the newest before removing them."""

    def workers(self, role: str) -> list[str]: ...

    def scale(self, role: str, replicas: int) -> None: ...


class ClusterActuator:
    """Scales a ``ScalableCluster``: ``tandem serve --planner`` (with or without
    ``--ray``) and ``tandem planner --actuator ray``."""

    def __init__(self, cluster: ScalableCluster) -> None:
        self.cluster = cluster

    def replicas(self, pool: str) -> int:
        return len(self.cluster.workers(pool))

    def scale(self, pool: str, replicas: int) -> None:
        self.cluster.scale(pool, replicas)
