"""Run one decode worker process (``tandem decode-worker``)."""

from __future__ import annotations

import asyncio
import contextlib

from tandem.common.engine_startup import load_engine
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.registry import RegistryWatcher, WorkerCapacity, WorkerInfo, WorkerRole
from tandem.common.registry.redis_io import REDIS_ERRORS
from tandem.common.worker_host import WorkerOptions, exit_for_restart, host_worker
from tandem.common.worker_load import BusyMeter, worker_load
from tandem.common.worker_metrics import WorkerMetrics, transfer_received
from tandem.decode_worker.service import DecodeService
from tandem.engine.async_engine import AsyncEngine
from tandem.kvtransfer.errors import PullFailure
from tandem.kvtransfer.held import serve_held_kv
from tandem.kvtransfer.ranks import ReceiverRanks, transfer_layout
from tandem.kvtransfer.receiver import KVReceiver
from tandem.protos import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

PEER_LOOKUP_TIMEOUT_S = 3.0


async def run(options: WorkerOptions, stop: asyncio.Event | None = None) -> None:
    kv_events = KVEventPublisher(options.redis_url, options.model_name, options.worker_id)
    kv_events.start()
    engine = load_engine(
        options,
        on_kv_events=kv_events.on_engine_events,
        detokenize=False,
        on_rank_lost=exit_for_restart,
    )
    layout = transfer_layout(
        options.model_name, engine.runner.layout, engine.config.tensor_parallel_size
    )
    ranks = None
    if engine.rank_control is not None:  # rank i pulls from the prefill replica's rank i
        ranks = ReceiverRanks(engine.rank_control, engine.runtime.device.type)
    receiver = KVReceiver(layout, options.worker_id, engine.runtime.device, options.tls, ranks)
    async_engine = AsyncEngine(engine)
    metrics = WorkerMetrics(options.model_name, "decode", lambda: async_engine.load)
    # The sending side, for the streams this worker hands to a peer (live migration).
    side = serve_held_kv(async_engine, layout, options, metrics)
    held, sender, kv_service = side.held, side.sender, side.servicer

    def received():
        stats = receiver.stats
        failures = {r.value: stats.failures.get(r, 0) for r in PullFailure}  # every reason, 0s too
        return transfer_received(stats.pulls, stats.blocks, stats.bytes, failures)

    metrics.report(received)
    service = DecodeService(
        async_engine,
        receiver,
        held,
        options.worker_id,
        options.kv_pull_timeout_s,
        metrics,
        kv_events,
    )
    async_engine.on_kv_pull = service.pull
    async_engine.start()
    capacity = WorkerCapacity(
        engine.num_kv_blocks,
        engine.runtime.block_size,
        engine.config.max_num_seqs,
        engine.runtime.max_model_len,
    )

    def make_info(address: str) -> WorkerInfo:
        held.kv_endpoint = address
        return WorkerInfo(
            options.worker_id, WorkerRole.DECODE, address, options.model_name, capacity, address
        )

    async def count_peers() -> int:
        """Other decode workers of this model in the registry (0 if it cannot be read)."""
        watcher = RegistryWatcher(options.redis_url, options.model_name)
        try:
            await asyncio.wait_for(watcher.start(), PEER_LOOKUP_TIMEOUT_S)
            peers = watcher.workers(WorkerRole.DECODE)
            return sum(1 for p in peers if p.info.worker_id != options.worker_id)
        except (TimeoutError, *REDIS_ERRORS):
            return 0
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def drain() -> None:
        await service.drain(options.drain_timeout_s, options.drain_migrate_after_s, count_peers)

    busy = BusyMeter()
    sweeper = asyncio.create_task(held.sweep())
    try:
        await host_worker(
            options,
            [
                lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s),
                lambda s: kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(kv_service, s),
            ],
            [
                worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
                kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
            ],
            make_info,
            lambda: worker_load(async_engine.load, busy),
            stop,
            engine_stalled_s=lambda: async_engine.stalled_for_s,
            metrics=metrics,
            drain=drain,
        )
    finally:
        sweeper.cancel()
        await asyncio.to_thread(sender.close)
        await receiver.close()
        await async_engine.stop()
        await asyncio.to_thread(engine.close)
        await kv_events.aclose()
