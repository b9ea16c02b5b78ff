"""gRPC stubs for the workers the router talks to: one channel per worker address,
opened on first use (mutual TLS when the router has an internal certificate) and closed
when the worker leaves the registry.

A worker leaves the registry *first* when it drains (SIGTERM): it deregisters, then
finishes its streams. So a departed worker's channel takes no new calls but is closed
with a grace period, letting those streams end on their own; only what is still open
after ``DEPARTED_GRACE_S`` is cancelled (and the orchestrator moves it elsewhere).
"""

from __future__ import annotations

import grpc

from tandem.common.grpc_server import MAX_MESSAGE_BYTES
from tandem.common.registry import WorkerRecord
from tandem.common.tls import InternalTLS, internal_channel
from tandem.protos import worker_pb2_grpc

DEPARTED_GRACE_S = 120.0
"""How long calls already running on a departed worker's channel may still take."""

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


class WorkerClients:
    def __init__(self, tls: InternalTLS | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def prefill(self, worker: WorkerRecord) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channel(worker.info.address))

    def decode(self, worker: WorkerRecord) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channel(worker.info.address))

    async def forget(self, worker: WorkerRecord, grace_s: float = DEPARTED_GRACE_S) -> None:
        """The worker left: new calls get a new channel; calls in flight on the old one
        may finish within ``grace_s`` (this waits for them)."""
        channel = self._channels.pop(worker.info.address, None)
        if channel is not None:
            await channel.close(grace=grace_s)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = internal_channel(address, self._tls, CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel
