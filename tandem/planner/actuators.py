"""Where the planner's decisions go. An actuator reports each pool's replica count and
sets it; scaling down must drain (the workers' own SIGTERM path does: leave the registry,
finish or hand over the streams, exit).

``DryRun`` only records; ``LocalClusterActuator`` scales the processes of a
``tandem.cli.launcher.LocalCluster`` (``tandem serve``). The Kubernetes actuator (patching
the Deployments' scale) and the Ray one come with those deployments' scaling APIs.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class Actuator(Protocol):
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


class LocalClusterActuator:
    def __init__(self, cluster) -> None:  # a tandem.cli.launcher.LocalCluster
        self.cluster = cluster

    def replicas(self, pool: str) -> int:
        return len(self.cluster.workers(pool))

    def scale(self, pool: str, replicas: int) -> None:
        self.cluster.scale(pool, replicas)
