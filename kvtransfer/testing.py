"""A prefill-side KV server on seeded random tensors, for tests and benchmarks.

``RandomKVServer(spec)`` spawns a child process that builds the caches
(``random_kv_caches``), grants one lease per entry of ``spec.leases`` and serves
``KVTransfer`` on ``127.0.0.1``. The parent rebuilds the same tensors with
``random_kv_caches`` to check what it pulled. ``spec.stall_lease`` makes pulls of one
lease wait before sending, so a test can kill the server mid-pull or run out a deadline.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import grpc
import torch

from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.leases import LeaseTable
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.service import KVTransferServicer
from tandem.protos import kv_transfer_pb2, kv_transfer_pb2_grpc


@dataclass(frozen=True)
class RandomKVSpec:
    layout: KVLayout
    num_blocks: int
    leases: tuple[tuple[int, ...], ...]
    """Block ids of each lease to grant, in order."""
    seed: int = 0
    lease_ttl_s: float = 600.0
    grpc_port: int = 0
    """0 picks a free port; pass a dead server's port to restart it in place."""
    worker_id: str = "prefill-test"
    stall_lease: int | None = None
    """Index into ``leases`` whose pulls wait ``stall_s`` seconds before sending."""
    stall_s: float = 0.0
    torch_threads: int | None = None
    """``torch.set_num_threads`` in the server; ``None`` keeps torch's default."""


@dataclass(frozen=True)
class ServingInfo:
    endpoint: str
    store_port: int
    lease_ids: tuple[str, ...]


def random_kv_caches(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Deterministic for a given (layout, num_blocks, seed), in any process."""
    generator = torch.Generator().manual_seed(seed)
    shape = layout.cache_shape(num_blocks)
    if layout.kv_cache_dtype.quantized:  # any bytes: codes and scales travel unread
        return [
            torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
            for _ in range(layout.num_layers)
        ]
    return [
        torch.randn(shape, generator=generator).to(layout.dtype) for _ in range(layout.num_layers)
    ]


class RandomKVServer:
    """A ``serve_random_kv`` child process; ``kill`` (SIGKILL) or use as a context
    manager. Construction waits up to ``start_timeout`` s for the server to listen."""

    def __init__(self, spec: RandomKVSpec, start_timeout: float = 60.0) -> None:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main, args=(spec, child_end), daemon=True)
        self.process.start()
        child_end.close()
        if not parent_end.poll(start_timeout):
            self.kill()
            raise TimeoutError(f"KV server did not start within {start_timeout} s")
        try:
            self.info: ServingInfo = parent_end.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(f"KV server exited with {self.process.exitcode}") from None

    @property
    def endpoint(self) -> str:
        return self.info.endpoint

    @property
    def lease_ids(self) -> tuple[str, ...]:
        return self.info.lease_ids

    def kill(self) -> None:
        """SIGKILL, as a crash would: no cleanup runs in the child."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def __enter__(self) -> RandomKVServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


async def serve_random_kv(spec: RandomKVSpec, on_ready: Callable[[ServingInfo], None]) -> None:
    """Serves until cancelled; ``on_ready`` gets the address and lease ids once listening."""
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    caches = random_kv_caches(spec.layout, spec.num_blocks, spec.seed)
    sender = KVSender(spec.layout, caches, "127.0.0.1", 0, spec.worker_id)
    leases = LeaseTable()
    lease_ids = tuple(
        leases.grant(f"request-{i}", ids, spec.lease_ttl_s) for i, ids in enumerate(spec.leases)
    )
    stalled = None if spec.stall_lease is None else lease_ids[spec.stall_lease]
    servicer = _StallingServicer(sender, leases, stalled, spec.stall_s)
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{spec.grpc_port}")
    await server.start()
    on_ready(ServingInfo(f"127.0.0.1:{port}", sender.store_port, lease_ids))
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=None)
        sender.close()


class _StallingServicer(KVTransferServicer):
    def __init__(
        self, sender: KVSender, leases: LeaseTable, stalled_lease: str | None, stall_s: float
    ) -> None:
        super().__init__(sender, leases, on_release=lambda block_ids: None)
        self._stalled_lease = stalled_lease
        self._stall_s = stall_s

    async def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.PullBlocksResponse:
        if request.lease_id == self._stalled_lease:
            await asyncio.sleep(self._stall_s)
        return await super().PullBlocks(request, context)


def _child_main(spec: RandomKVSpec, ready: Connection) -> None:
    asyncio.run(serve_random_kv(spec, ready.send))
