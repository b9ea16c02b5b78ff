"""Starting the other ranks of a replica, and the loop they run.

Rank 0 is the engine's own process (``LLMEngine``); it hosts the rendezvous store,
starts ranks 1..N-1 and joins the groups with them. Ranks start as

- **local processes** (``multiprocessing`` spawn): children of rank 0, so a rank 0 that
  dies takes them along (their next plan receive fails);
- **Ray actors**, when Ray is initialised in rank 0's process: placed in bundles
  1..N-1 of the placement group rank 0 runs in (the Ray launcher puts one replica in
  one ``STRICT_PACK`` group), or in a group of their own. Rank 0 owns them, so Ray kills
  them when rank 0 dies.

Either way a rank that dies is noticed by ``RankWatch`` within a second (and by the
next collective within milliseconds), and the replica fails as a whole
(``RankLost``): a worker then exits for its supervisor to restart it, ranks and all.
"""

from __future__ import annotations

import abc
import logging
import os
import pickle
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tandem.engine.parallel.control import RankControl, RankControlServer
from tandem.engine.parallel.group import Rendezvous, TensorParallelGroup, host_store
from tandem.engine.parallel.plan import ForwardPlan, PlanChannel, PlanKind
from tandem.ray.spec import RAY_NAMESPACE_ENV

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start: the engine settings and where to meet rank 0."""

    config: Any  # EngineConfig (not imported: this module is imported by config's users)
    rank: int
    rendezvous: Rendezvous


def run_rank(spec: RankSpec) -> None:
    """The whole life of ranks 1..N-1: load this rank's slice, then run the forwards
    rank 0 plans until it says stop (or is lost)."""
    from tandem.engine.llm_engine import build_runner
    from tandem.kvtransfer.ranks import RankKVAgent, transfer_layout

    runner = build_runner(spec.config, spec.rank, spec.rendezvous)
    group = runner.tp
    channel = PlanChannel(group)
    agent: RankKVAgent | None = None
    try:
        with torch.inference_mode():
            while True:
                kind, header, payload = channel.receive()
                if kind is PlanKind.STOP:
                    return
                if kind is PlanKind.ALLOCATE_KV:
                    runner.allocate_kv_cache(int(header[1]))
                    layout = transfer_layout("", runner.layout, group.size)
                    agent = RankKVAgent(layout, runner.kv_caches, group.local_host, group.rank)
                    RankControlServer(
                        agent, spec.rendezvous, spec.rank, group.store, group.local_host
                    )
                elif kind is PlanKind.FORWARD:
                    runner.run_plan(ForwardPlan.decode(header, payload))
                elif kind is PlanKind.UNPACK_KV:
                    agent.kv_unpack(int(header[1]), payload.tolist())
                elif kind is PlanKind.FILL_LORA:
                    runner.fill_lora_slot(int(header[1]), payload)
    finally:
        if agent is not None:
            agent.close()


def _run_rank_process(spec: RankSpec) -> None:
    """A local rank process's entry point: a lost rank 0 ends it quietly."""
    from tandem.engine.parallel.group import RankLost

    logging.basicConfig(level=logging.WARNING)
    try:
        run_rank(spec)
    except RankLost as lost:
        log.warning("%s; rank %d exits", lost, spec.rank)


class Ranks(abc.ABC):
    """Ranks 1..N-1 of a replica, as rank 0 sees them."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether every rank still runs."""

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Waits for the ranks to end (after the STOP plan), then makes sure they did."""


class LocalRanks(Ranks):
    """Ranks as child processes of a fresh interpreter each (not ``multiprocessing``:
    a spawned child re-imports the parent's ``__main__``, which a user's script without
    a ``__main__`` guard would re-run). The spec goes to the child on its stdin."""

    def __init__(self, specs: list[RankSpec]) -> None:
        self.processes = []
        for spec in specs:
            process = subprocess.Popen(
                [sys.executable, "-c", f"import {__name__} as r; r.rank_process_main()"],
                stdin=subprocess.PIPE,
            )
            process.stdin.write(pickle.dumps(spec))
            process.stdin.close()
            self.processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def stop(self, timeout_s: float) -> None:
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def rank_process_main() -> None:
    """Entry point of a local rank process (``LocalRanks``)."""
    _run_rank_process(pickle.load(sys.stdin.buffer))


class RayRanks(Ranks):
    def __init__(self, specs: list[RankSpec], resources: dict[str, float]) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self._remove_group = ray, remove_placement_group
        group = ray.util.get_current_placement_group()
        self._own_group = None
        first_bundle = 1
        if group is None or len(group.bundle_specs) < len(specs) + 1:
            group = placement_group([resources] * len(specs), strategy="STRICT_PACK")
            ray.get(group.ready(), timeout=120)
            self._own_group, first_bundle = group, 0
        actor = ray.remote(max_restarts=0)(RankActor)
        self.actors, self.runs = [], []
        for i, spec in enumerate(specs):
            bundle = group.bundle_specs[first_bundle + i]
            handle = actor.options(
                name=f"{_replica_name()}-rank{spec.rank}",
                namespace=os.environ.get(RAY_NAMESPACE_ENV) or None,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first_bundle + i
                ),
            ).remote()
            self.actors.append(handle)
            self.runs.append(handle.run.remote(spec))

    @property
    def pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def alive(self) -> bool:
        done, _ = self._ray.wait(self.runs, num_returns=1, timeout=0)
        return not done

    def stop(self, timeout_s: float) -> None:
        ray = self._ray
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for handle in self.actors:
            ray.kill(handle)
        if self._own_group is not None:
            self._remove_group(self._own_group)


class RankActor:
    """A Ray actor hosting one rank (ranks 1..N-1); ``run`` returns when it stops."""

    def run(self, spec: RankSpec) -> None:
        _run_rank_process(spec)

    def pid(self) -> int:
        return os.getpid()


def _replica_name() -> str:
    """The rank-0 actor's name when there is one (``tandem-decode-0``), else ``tandem-tp``."""
    import ray

    try:
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # not in an actor
        name = None
    return f"{name or 'tandem-tp'}-{uuid.uuid4().hex[:4]}"


def start_ranks(
    config: Any, size: int, device: torch.device
) -> tuple[TensorParallelGroup, Ranks, Any]:
    """Starts ranks 1..size-1 and joins the groups with them as rank 0. Returns rank 0's
    group, the ranks, and the store (keep it alive as long as the group)."""
    use_ray = _ray_initialized()
    host = "127.0.0.1"
    if use_ray:
        import ray

        host = ray.util.get_node_ip_address()
    store, rendezvous = host_store(host, size, uuid.uuid4().hex)
    specs = [RankSpec(_rank_config(config, r, use_ray), r, rendezvous) for r in range(1, size)]
    if use_ray:
        cpus = max(1.0, float(config.num_threads or 1))
        bundle = {"CPU": cpus, **({"GPU": 1.0} if device.type == "cuda" else {})}
        ranks: Ranks = RayRanks(specs, bundle)
    else:
        ranks = LocalRanks(specs)
    try:
        group = TensorParallelGroup.join(rendezvous, 0, device, store=store)
    except BaseException:
        ranks.stop(0)
        raise
    return group, ranks, store


def connect_control(group: TensorParallelGroup) -> RankControl:
    """Rank 0's call channel to the other ranks (they open it once their KV cache is
    allocated)."""
    return RankControl(group.rendezvous, group.store)


def _ray_initialized() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _rank_config(config: Any, rank: int, use_ray: bool) -> Any:
    """Local ranks on a multi-GPU host take GPU ``rank``; a Ray actor sees only its own."""
    if not use_ray and config.device in ("auto", "cuda") and torch.cuda.device_count() > rank:
        return replace(config, device=f"cuda:{rank}")
    return config


class RankWatch:
    """Checks every second that the other ranks live; calls ``on_lost`` once if not."""

    def __init__(self, ranks: Ranks, on_lost: Callable[[str], None]) -> None:
        self._ranks, self._on_lost = ranks, on_lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            if not self._ranks.alive():
                if not self._stopped.is_set():
                    self._on_lost("a tensor-parallel rank of this replica died")
                return
