"""LoRA adapters loaded and dropped across the fleet at run time (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

A load goes to every live worker, prefill and decode, at once (``LoadLoRA``); it holds
only if every worker took it: one refusal (a bad adapter: its message names the fault)
unloads it again from those that took it, so the fleet never serves an adapter from
half its workers by accident. The registry advertises each worker's adapters with its
next heartbeat, which is when requests may name it (``RequestValidator``). Adapters
loaded here are loaded again on every worker that joins later (a scale-up, a restart),
so the fleet stays uniform; ``--lora-modules`` adapters come with the worker's own
command line.
"""

from __future__ import annotations

import asyncio
import logging

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
    def __init__(self, watcher: RegistryWatcher, clients: WorkerClients) -> None:
        self.watcher = watcher
        self.clients = clients
        self.loaded: dict[str, str] = {}
        """Adapters loaded through this router: name -> path (replayed on joins)."""
        self._background: set[asyncio.Task[None]] = set()

    def _workers(self) -> list[WorkerRecord]:
        return [r for role in WorkerRole for r in self.watcher.workers(role)]

    def _stub(self, worker: WorkerRecord):
        if worker.info.role is WorkerRole.PREFILL:
            return self.clients.prefill(worker)
        return self.clients.decode(worker)

    async def load(self, name: str, path: str) -> int:
        """Load adapter ``name`` from ``path`` on every live worker; returns how many.
        ``LoRAUpdateError`` when any refuses (the others drop it again) or none is live."""
        workers = self._workers()
        if not workers:
            raise LoRAUpdateError(grpc.StatusCode.UNAVAILABLE, "no worker is registered")
        message = worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path)
        results = await asyncio.gather(
            *(self._stub(w).LoadLoRA(message, timeout=CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            took = [
                w for w, r in zip(workers, results, strict=True) if not isinstance(r, BaseException)
            ]
            await self._unload_from(name, took)
            raise _refusal(failures[0])
        self.loaded[name] = path
        return len(workers)

    async def unload(self, name: str) -> int:
        """Drop adapter ``name`` from every live worker; returns how many held it.
        ``LoRAUpdateError``: NOT_FOUND when none did, FAILED_PRECONDITION while requests
        of it still run (those that had none dropped it)."""
        self.loaded.pop(name, None)
        results = await self._unload_from(name, self._workers())
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise _refusal(failures[0])
        found = sum(1 for r in results if r.found)
        if not found:
            raise LoRAUpdateError(
                grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded on any worker"
            )
        return found

    def worker_joined(self, worker: WorkerRecord) -> None:
        """Load the adapters loaded here onto a worker that joined (in the background)."""
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
            log.warning(
                "loading LoRA adapter %r on %s failed: %s",
                name,
                worker.info.worker_id,
                err.details(),
            )

    async def _unload_from(self, name: str, workers: list[WorkerRecord]) -> list:
        message = worker_pb2.UnloadLoRARequest(lora_name=name)
        return await asyncio.gather(
            *(self._stub(w).UnloadLoRA(message, timeout=CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )


def _refusal(error: BaseException) -> LoRAUpdateError:
    if isinstance(error, grpc.aio.AioRpcError):
        return LoRAUpdateError(error.code(), error.details() or error.code().name)
    return LoRAUpdateError(grpc.StatusCode.INTERNAL, str(error) or type(error).__name__)
