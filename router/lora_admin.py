"""LoRA adapters loaded and dropped across the fleet at run time (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

A load goes to every live worker that serves adapters (``--enable-lora``), prefill and
decode, at once (``LoadLoRA``); it holds only if every one took it: one refusal (a bad
adapter: its message names the fault) unloads it again from those it was new on, so the
fleet never serves an adapter from half its workers by accident. An unload first asks
every holder whether it may (no unfinished request of the adapter), then drops it.
The registry advertises each worker's adapters with its next heartbeat, which is when
requests may name it (``RequestValidator``). Adapters loaded here are loaded again on
every worker that joins later (a scale-up, a restart), so the fleet stays uniform;
``--lora-modules`` adapters come with the worker's own command line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

import grpc

from tandem.common.registry import RegistryWatcher, WorkerRecord, WorkerRole
from tandem.protos import worker_pb2
from tandem.router.clients import WorkerClients

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0
"""A load reads the adapter from disk on each worker."""


class LoRAUpdateError(Exception):
    """A load or unload the fleet refused; ``code`` is the workers' gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LoRAFleet:
    def __init__(
        self, watcher: RegistryWatcher, clients: WorkerClients, reserved: Collection[str] = ()
    ) -> None:
        """``reserved``: names an adapter may not take (the base model's)."""
        self.watcher = watcher
        self.clients = clients
        self.reserved = frozenset(reserved)
        self.loaded: dict[str, str] = {}
        """Adapters loaded through this router: name -> path (replayed on joins)."""
        self._background: set[asyncio.Task[None]] = set()

    def _workers(self) -> list[WorkerRecord]:
        """The live workers that serve adapters (started with ``--enable-lora``)."""
        return [r for role in WorkerRole for r in self.watcher.workers(role) if r.load.max_loras]

    def _stub(self, worker: WorkerRecord):
        if worker.info.role is WorkerRole.PREFILL:
            return self.clients.prefill(worker)
        return self.clients.decode(worker)

    async def load(self, name: str, path: str) -> int:
        """Load adapter ``name`` from ``path`` on every live worker that serves adapters;
        returns how many. ``LoRAUpdateError`` when the name is taken, no decode worker
        serves adapters, or any worker refuses (those that took it drop it again)."""
        workers = self._workers()
        if name in self.reserved:
            raise LoRAUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is the base model's name"
            )
        if any(name in w.load.adapters for w in workers):
            raise LoRAUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"LoRA adapter {name!r} is already loaded (unload it first)",
            )
        if not any(w.info.role is WorkerRole.DECODE for w in workers):
            raise LoRAUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no decode worker serves LoRA adapters (start the workers with --enable-lora)",
            )
        message = worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path)
        results = await asyncio.gather(
            *(self._stub(w).LoadLoRA(message, timeout=CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            added = [
                w
                for w, r in zip(workers, results, strict=True)
                if not isinstance(r, BaseException) and r.added
            ]
            await self._unload_from(name, added)
            raise _refusal(failures[0])
        self.loaded[name] = path
        return len(workers)

    async def unload(self, name: str) -> int:
        """Drop adapter ``name`` from every live worker; returns how many held it.
        ``LoRAUpdateError``: NOT_FOUND when none does, FAILED_PRECONDITION (nothing
        dropped) while requests of it are unfinished on any worker."""
        workers = self._workers()  # each says whether it holds it: heartbeats may lag
        checks = await self._unload_from(name, workers, dry_run=True)
        failures = [r for r in checks if isinstance(r, BaseException)]
        if failures:
            raise _refusal(failures[0])
        holders = [w for w, r in zip(workers, checks, strict=True) if r.found]
        if not holders:
            raise LoRAUpdateError(
                grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded on any worker"
            )
        results = await self._unload_from(name, holders)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:  # a request of it arrived since the check: the rest dropped it
            raise _refusal(failures[0])
        self.loaded.pop(name, None)
        return sum(1 for r in results if r.found)

    def worker_joined(self, worker: WorkerRecord) -> None:
        """Load the adapters loaded here onto a worker that joined (in the background)."""
        if not worker.load.max_loras:
            return
        for name, path in self.loaded.items():
            if name in worker.load.adapters:
                continue
            task = asyncio.get_running_loop().create_task(self._replay(worker, name, path))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _replay(self, worker: WorkerRecord, name: str, path: str) -> None:
        message = worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path)
        try:
            await self._stub(worker).LoadLoRA(message, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            worker_id = worker.info.worker_id
            log.warning("loading LoRA adapter %r on %s failed: %s", name, worker_id, err.details())

    async def _unload_from(
        self, name: str, workers: list[WorkerRecord], dry_run: bool = False
    ) -> list:
        message = worker_pb2.UnloadLoRARequest(lora_name=name, dry_run=dry_run)
        return await asyncio.gather(
            *(self._stub(w).UnloadLoRA(message, timeout=CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )


def _refusal(error: BaseException) -> LoRAUpdateError:
    if isinstance(error, grpc.aio.AioRpcError):
        return LoRAUpdateError(error.code(), error.details() or error.code().name)
    return LoRAUpdateError(grpc.StatusCode.INTERNAL, str(error) or type(error).__name__)
