"""What a Tandem cluster asks of Ray: where to run (the Ray address and namespace), the
tensor-parallel size, and each rank's resources and node labels, per role.

One replica of a role is one placement group, ``STRICT_PACK`` (all ranks on one node),
with one bundle per tensor-parallel rank; rank 0 — the replica's actor — sits in
bundle 0 and the engine places the other ranks in the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NAMESPACE = "tandem"
"""The default Ray namespace; every actor of a cluster lives in its cluster's."""
CONTROLLER = "tandem-controller"
ROUTER = "tandem-router"
REDIS = "tandem-redis"
ROLES = ("prefill", "decode")
RAY_NAMESPACE_ENV = "TANDEM_RAY_NAMESPACE"
"""Set in a replica's rank-0 process: the Ray namespace its rank actors are named in, the
replica's own (Ray tells an actor its job's namespace, not its own)."""


def actor_name(component: str) -> str:
    """The Ray actor (and placement group) name of ``prefill-0``, ``decode-1``, ..."""
    return f"tandem-{component}"


@dataclass(frozen=True)
class RankResources:
    """What one tensor-parallel rank asks Ray for, and where it may run.

    ``memory_gb``: host memory reserved for the rank (Ray's ``memory`` resource; from
    ``--kv-cache-memory-gb`` on CPU replicas). ``custom``: other Ray resources by name
    (``{"accelerator_type:H100": 0.001}``, a resource of your own). ``labels``: a Ray
    label selector every rank's node must match (``{"pool": "decode"}``, values may be
    ``!spot`` or ``in(a,b)``)."""

    cpus: float = 1.0
    gpus: float = 0.0
    memory_gb: float | None = None
    custom: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"CPUs and GPUs per rank must be >= 0, got {self.cpus}, {self.gpus}")
        if self.cpus == 0 and self.gpus == 0:
            raise ValueError("a rank needs a CPU or a GPU: --cpus-per-rank or --gpus-per-rank")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory per rank must be > 0 GB, got {self.memory_gb}")

    @property
    def bundle(self) -> dict[str, float]:
        """One placement-group bundle: this rank's resources."""
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        if self.memory_gb is not None:
            bundle["memory"] = self.memory_gb * 2**30
        return {**bundle, **self.custom}

    @property
    def actor_options(self) -> dict[str, object]:
        """``.options(...)`` of the actor that holds a whole bundle."""
        options: dict[str, object] = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if self.memory_gb is not None:
            options["memory"] = self.memory_gb * 2**30
        if self.custom:
            options["resources"] = dict(self.custom)
        return options


@dataclass(frozen=True)
class RaySpec:
    """How a cluster runs on Ray (``tandem serve --ray``).

    ``address``: ``None`` uses the Ray this process is connected to or starts a local
    one; ``auto`` finds a cluster started with ``ray start``; ``HOST:PORT`` (its GCS) or
    ``ray://HOST:PORT`` (Ray Client) joins that one."""

    address: str | None = None
    namespace: str = NAMESPACE
    tensor_parallel_size: int = 1
    prefill: RankResources = field(default_factory=RankResources)
    decode: RankResources = field(default_factory=RankResources)
    num_cpus: int | None = None
    """CPUs of a local Ray this process starts (default: the machine's, or as many as
    the replicas ask for if that is more)."""
    include_dashboard: bool | None = None
    """Of a local Ray this process starts (``None``: Ray's default, on when installed);
    ``ray list actors`` and the state API need it."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    def resources(self, role: str) -> RankResources:
        return self.prefill if role == "prefill" else self.decode

    def bundles(self, role: str) -> list[dict[str, float]]:
        """The placement group of one ``role`` replica: a bundle per rank."""
        return [self.resources(role).bundle] * self.tensor_parallel_size

    def label_selectors(self, role: str) -> list[dict[str, str]] | None:
        labels = self.resources(role).labels
        return [dict(labels)] * self.tensor_parallel_size if labels else None
