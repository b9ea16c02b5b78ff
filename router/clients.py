"""gRPC stubs for the workers the router talks to: one channel per worker address,
opened on first use and closed when the worker leaves the registry."""

from __future__ import annotations

import grpc

from tandem.common.grpc_server import MAX_MESSAGE_BYTES
from tandem.common.registry import WorkerRecord
from tandem.protos import worker_pb2_grpc

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


class WorkerClients:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def prefill(self, worker: WorkerRecord) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channel(worker.info.address))

    def decode(self, worker: WorkerRecord) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channel(worker.info.address))

    async def forget(self, worker: WorkerRecord) -> None:
        channel = self._channels.pop(worker.info.address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel
