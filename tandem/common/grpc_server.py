"""Start a ``grpc.aio`` server the way every Tandem process does: bound to a port,
with ``grpc.health.v1`` health and server reflection (so ``grpcurl`` works)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 2**20

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)

AddServicer = Callable[[grpc.aio.Server], None]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_server(
    host: str, port: int, add_servicers: Sequence[AddServicer], service_names: Sequence[str]
) -> RunningServer:
    """Bind ``host:port`` (port 0 picks a free one), register the services, health and
    reflection, start serving. ``service_names`` are full names (``tandem.v1.Generation``)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    for add in add_servicers:
        add(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    running = RunningServer(server, bound, health)
    await running.set_serving(True)
    return running
