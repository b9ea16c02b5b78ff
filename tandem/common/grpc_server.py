"""Start a ``grpc.aio`` server the way every Tandem process does: bound to a port,
with ``grpc.health.v1`` health and server reflection (so ``grpcurl`` works).

Health answers two questions, as Kubernetes probes ask them:

- **readiness**, the overall status (service ``""``) and each served service's: may
  traffic be sent here? ``SERVING`` only while the process can do its work (a router
  that sees no decode worker is not ready);
- **liveness**, the service ``tandem.liveness``: is the process alive and its event loop
  answering? ``SERVING`` from start to shutdown, whatever readiness says, so a probe can
  tell "restart me" from "don't send me traffic".
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from tandem.common.tls import InternalTLS, TLSFiles

MAX_MESSAGE_BYTES = 64 * 2**20

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)

AddServicer = Callable[[grpc.aio.Server], None]


class _Malformed:
    """What a request that is not a valid message of its type deserializes to."""

    __slots__ = ("error",)

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request whose bytes are not a valid message of its type with
    ``INVALID_ARGUMENT`` naming the type (gRPC itself would answer ``UNKNOWN`` with a
    Python exception's text). The servicer never sees such a request; for a valid one
    the cost is one check (and, for a stream, one generator hop per message)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        deserialize = handler.request_deserializer
        method = handler_call_details.method

        def safe_deserialize(data: bytes) -> object:
            try:
                return deserialize(data)
            except DecodeError as error:
                return _Malformed(error)

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request to {method} is not a valid protobuf message of its type "
                f"({request.error})",
            )

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> object:
                if type(request) is _Malformed:
                    await refuse(request, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, safe_deserialize, handler.response_serializer
            )
        stream = handler.unary_stream
        if not inspect.isasyncgenfunction(stream):  # writes with context.write, or aborts

            async def unary_stream_writer(
                request: object, context: grpc.aio.ServicerContext
            ) -> object:
                if type(request) is _Malformed:
                    await refuse(request, context)
                return await stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_writer, safe_deserialize, handler.response_serializer
            )

        async def unary_stream(
            request: object, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[object]:
            if type(request) is _Malformed:
                await refuse(request, context)
            async for response in stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, safe_deserialize, handler.response_serializer
        )


LIVENESS_SERVICE = "tandem.liveness"
"""The health service name a liveness probe asks for."""


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: tuple[str, ...]
    ready: bool = False
    health_server: grpc.aio.Server | None = None
    """The plaintext health-only server (``health_port``), when there is one."""
    health_port: int | None = None

    async def set_serving(self, serving: bool) -> None:
        """Readiness: the overall status and every served service's."""
        self.ready = serving
        status = _status(serving)
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, _status(False))
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


async def start_server(
    host: str,
    port: int,
    add_servicers: Sequence[AddServicer],
    service_names: Sequence[str],
    ready: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: TLSFiles | InternalTLS | None = None,
    health_port: int | None = None,
) -> RunningServer:
    """Bind ``host:port`` (port 0 picks a free one), register the services, health and
    reflection, start serving. ``service_names`` are full names (``tandem.v1.Generation``).
    ``ready=False``: readiness starts ``NOT_SERVING`` until ``set_serving(True)``;
    liveness is ``SERVING`` either way. ``tls``: plaintext when ``None``; server TLS
    (``TLSFiles``) or mutual TLS, clients need a certificate the CA signed (``InternalTLS``).
    ``health_port``: also answer ``grpc.health.v1`` alone, in plaintext, on that port (0:
    a free one) — for probes that cannot present a certificate (a kubelet's)."""
    server = grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=(MalformedRequestInterceptor(), *interceptors)
    )
    for add in add_servicers:
        add(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    health_server, health_bound = None, None
    if health_port is not None:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        health_bound = health_server.add_insecure_port(f"{host}:{health_port}")
        if health_bound == 0:
            raise OSError(f"cannot bind the health port {host}:{health_port}")
        await health_server.start()
    await server.start()
    running = RunningServer(
        server, bound, health, tuple(service_names), False, health_server, health_bound
    )
    await health.set(LIVENESS_SERVICE, _status(True))
    await running.set_serving(ready)
    return running
