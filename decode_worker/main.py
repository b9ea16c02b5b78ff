"""Run one decode worker process (``tandem decode-worker``)."""

from __future__ import annotations

import asyncio

from tandem.common.engine_startup import load_engine
from tandem.common.kv_events.publisher import KVEventPublisher
from tandem.common.registry import WorkerCapacity, WorkerInfo, WorkerRole
from tandem.common.worker_host import WorkerOptions, exit_for_restart, host_worker
from tandem.common.worker_load import BusyMeter, worker_load
from tandem.common.worker_metrics import WorkerMetrics, transfer_received
from tandem.decode_worker.service import DecodeService
from tandem.engine.async_engine import AsyncEngine
from tandem.kvtransfer.errors import PullFailure
from tandem.kvtransfer.ranks import ReceiverRanks, transfer_layout
from tandem.kvtransfer.receiver import KVReceiver
from tandem.protos import worker_pb2, worker_pb2_grpc


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

    def received():
        stats = receiver.stats
        failures = {r.value: stats.failures.get(r, 0) for r in PullFailure}  # every reason, 0s too
        return transfer_received(stats.pulls, stats.blocks, stats.bytes, failures)

    metrics.report(received)
    service = DecodeService(
        async_engine, receiver, options.worker_id, options.kv_pull_timeout_s, metrics, kv_events
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
        return WorkerInfo(
            options.worker_id, WorkerRole.DECODE, address, options.model_name, capacity
        )

    busy = BusyMeter()
    try:
        await host_worker(
            options,
            [lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s)],
            [worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name],
            make_info,
            lambda: worker_load(async_engine.load, busy),
            stop,
            engine_stalled_s=lambda: async_engine.stalled_for_s,
            metrics=metrics,
        )
    finally:
        await receiver.close()
        await async_engine.stop()
        await asyncio.to_thread(engine.close)
        await kv_events.aclose()
