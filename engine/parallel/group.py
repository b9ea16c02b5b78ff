"""The process groups of one tensor-parallel replica.

Ranks rendezvous on a ``TCPStore`` hosted by rank 0 and build two groups on it (no
global ``init_process_group``, so one process can host a replica next to its KV-transfer
pair groups, and a test process can host several replicas in turn):

- the **model group** carries the layers' all-reduce and the logits gather: NCCL on
  CUDA, gloo on the CPU;
- the **plan group** (always gloo, host memory) carries rank 0's step plans
  (``parallel.plan``). It has no useful timeout: an idle replica sends nothing for
  hours. A rank that dies closes its sockets, which fails the peers' pending and next
  operations within milliseconds (gloo's "Connection closed by peer"); that is how a
  replica notices a lost rank (``RankLost``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.kvtransfer.pair import local_address_towards

MODEL_GROUP_TIMEOUT = timedelta(minutes=5)
"""No single collective of a forward takes this long; past it the replica is broken."""
PLAN_GROUP_TIMEOUT = timedelta(days=365)
"""Followers wait for the next plan as long as the replica lives."""


class RankLost(RuntimeError):
    """Another rank of this replica is gone (dead process, closed group). The replica
    cannot continue; its supervisor restarts it as a whole."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a replica's ranks meet: rank 0's store. Picklable (sent to new ranks)."""

    host: str
    port: int
    world_size: int
    key: str
    """Store prefix of this replica's groups, unique per start of the replica."""


class TensorParallelGroup:
    """One rank's view of its replica: rank, size and the two groups."""

    def __init__(
        self,
        rank: int,
        size: int,
        model_group: dist.ProcessGroup,
        plan_group: dist.ProcessGroup,
        device: torch.device,
        rendezvous: Rendezvous | None = None,
        store: dist.Store | None = None,
        local_host: str = "127.0.0.1",
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self._model = model_group
        self._plan = plan_group
        self.rendezvous, self.store = rendezvous, store
        self.local_host = local_host
        """The address this rank's sockets bind to (reachable from rank 0)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(
        cls,
        rendezvous: Rendezvous,
        rank: int,
        device: torch.device,
        store: dist.Store | None = None,
        timeout: timedelta = MODEL_GROUP_TIMEOUT,
    ) -> TensorParallelGroup:
        """Joins the replica's groups as ``rank``; blocks until every rank joined (or
        ``timeout``). Rank 0 passes the store it hosts; the others connect to it."""
        if store is None:
            store = dist.TCPStore(
                rendezvous.host,
                rendezvous.port,
                is_master=False,
                timeout=timeout,
            )
        size = rendezvous.world_size
        plan_store = dist.PrefixStore(f"{rendezvous.key}/plan/", store)
        model_store = dist.PrefixStore(f"{rendezvous.key}/model/", store)
        # Bound to the address that routes to rank 0 (itself for rank 0): ranks may be
        # on other hosts, and gloo's default binds to what the hostname resolves to.
        local = local_address_towards(rendezvous.host, rendezvous.port)
        plan = _gloo(plan_store, rank, size, local, PLAN_GROUP_TIMEOUT)
        if device.type == "cuda":
            # A timed-out collective aborts the communicator instead of the process, so
            # the error surfaces as ``RankLost`` and the supervisor restarts the replica.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            model = dist.ProcessGroupNCCL(model_store, rank, size, options)
        else:
            model = _gloo(model_store, rank, size, local, timeout)
        return cls(rank, size, model, plan, device, rendezvous, store, local)

    # --- the model's collectives (every rank calls them in the same order) --------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks, in place; returns it."""
        self._wait(self._model.allreduce(tensor), "all-reduce")
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over the ranks, in place; returns it."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._wait(self._model.allreduce([tensor], options), "all-reduce (max)")
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the ranks' ``tensor`` concatenated along the last dim; the other
        ranks get ``None``. Every rank's ``tensor`` has the same shape."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_first else []
        self._wait(self._model.gather(parts, tensor, 0), "gather")
        return torch.cat(parts, dim=-1) if self.is_first else None

    # --- the plan channel ---------------------------------------------------------------

    def broadcast_plan(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends ``tensor`` (CPU, int64); the others receive into it."""
        self._wait(self._plan.broadcast(tensor, 0), "plan broadcast")

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else "failed"
            raise RankLost(f"tensor-parallel rank {self.rank}: {what} failed: {first}") from error


def host_store(host: str, world_size: int, key: str) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store on a free port, and the rendezvous the other ranks join with."""
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=MODEL_GROUP_TIMEOUT
    )
    return store, Rendezvous(host, store.port, world_size, key)


def _gloo(
    store: dist.Store, rank: int, size: int, host: str, timeout: timedelta
) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)
