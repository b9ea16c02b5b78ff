"""Run one prefill worker process (``tandem prefill-worker``)."""

from __future__ import annotations

import asyncio

from tandem.common.engine_startup import load_engine
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerRole
from tandem.common.worker_host import WorkerOptions, exit_for_restart, host_worker
from tandem.common.worker_load import BusyMeter, worker_load
from tandem.common.worker_metrics import WorkerMetrics
from tandem.engine.async_engine import AsyncEngine
from tandem.kvtransfer.held import serve_held_kv
from tandem.kvtransfer.ranks import transfer_layout
from tandem.prefill_worker.service import PrefillService
from tandem.protos import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc


async def run(options: WorkerOptions, stop: asyncio.Event | None = None) -> None:
    kv_events = KVEventPublisher(options.redis_url, options.model_name, options.worker_id)
    kv_events.start()
    engine = load_engine(
        options,
        on_kv_events=kv_events.on_engine_events,
        detokenize=False,
        on_rank_lost=exit_for_restart,
    )
    async_engine = AsyncEngine(engine)
    async_engine.start()
    tp_size = engine.config.tensor_parallel_size
    layout = transfer_layout(options.model_name, engine.runner.layout, tp_size)
    metrics = WorkerMetrics(options.model_name, "prefill", lambda: async_engine.load)
    side = serve_held_kv(async_engine, layout, options, metrics)
    held, sender, kv_service = side.held, side.sender, side.servicer
    service = PrefillService(async_engine, held, sender, options.worker_id, metrics, kv_events)
    capacity = WorkerCapacity(
        engine.num_kv_blocks,
        engine.runtime.block_size,
        engine.config.max_num_seqs,
        engine.runtime.max_model_len,
    )

    def make_info(address: str) -> WorkerInfo:
        held.kv_endpoint = address
        return WorkerInfo(
            options.worker_id, WorkerRole.PREFILL, address, options.model_name, capacity, address
        )

    sweeper = asyncio.create_task(held.sweep())
    busy = BusyMeter()
    try:
        await host_worker(
            options,
            [
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, s),
                lambda s: kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(kv_service, s),
            ],
            [
                worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,
                kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
            ],
            make_info,
            lambda: worker_load(async_engine.load, busy),
            stop,
            engine_stalled_s=lambda: async_engine.stalled_for_s,
            metrics=metrics,
        )
    finally:
        sweeper.cancel()
        await asyncio.to_thread(sender.close)
        await async_engine.stop()
        await asyncio.to_thread(engine.close)
        await kv_events.aclose()
