"""Run the router process (``tandem router``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from protos import generation_pb2, generation_pb2_grpc
from router.clients import WorkerClients
from router.orchestrator import Orchestrator, OrchestratorConfig
from router.policy import PolicyName, make_policy
from router.service import GenerationService
from router.validation import RequestValidator
from tandem.grpc_server import start_server
from tandem.process import stop_on_signals
from tandem.registry import RegistryWatcher, WorkerRecord
from tandem.tokenizer import Tokenizer


@dataclass(frozen=True)
class RouterOptions:
    model_dir: str
    model_name: str
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 50051
    prefill_policy: PolicyName = PolicyName.LEAST_LOADED
    decode_policy: PolicyName = PolicyName.LEAST_LOADED
    disaggregation_min_tokens: int = 32
    max_pending_requests: int = 1024
    max_model_len: int | None = None


async def run(options: RouterOptions, stop: asyncio.Event | None = None) -> None:
    stop = stop or stop_on_signals()
    clients = WorkerClients()
    background: set[asyncio.Task[None]] = set()

    def on_leave(worker: WorkerRecord) -> None:
        task = asyncio.get_running_loop().create_task(clients.forget(worker))
        background.add(task)
        task.add_done_callback(background.discard)

    watcher = RegistryWatcher(options.redis_url, options.model_name, on_leave=on_leave)
    await watcher.start()
    orchestrator = Orchestrator(
        watcher,
        clients,
        make_policy(options.prefill_policy),
        make_policy(options.decode_policy),
        OrchestratorConfig(disaggregation_min_tokens=options.disaggregation_min_tokens),
    )
    validator = RequestValidator.from_dir(
        options.model_dir, options.model_name, options.max_model_len
    )
    service = GenerationService(
        validator, Tokenizer.from_dir(options.model_dir), orchestrator, options.max_pending_requests
    )
    server = await start_server(
        options.host,
        options.port,
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(service, s)],
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
    )
    print(f"READY router {options.host}:{server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        await watcher.stop()
        await clients.close()
