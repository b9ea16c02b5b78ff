"""The ``LoadLoRA`` / ``UnloadLoRA`` calls every worker serves (prefill and decode
alike): an adapter loaded or dropped at run time, as the router's
``/v1/load_lora_adapter`` fans it out. The adapter is read off the engine thread, so
running requests keep stepping while it loads; a bad one is refused with
``INVALID_ARGUMENT`` naming the fault, and nothing changes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from tandem.common.lora import LoRARequest
from tandem.protos import worker_pb2

if TYPE_CHECKING:
    from tandem.engine.async_engine import AsyncEngine


class LoRAAdmin:
    """Mixed into both workers' servicers, which hold the ``AsyncEngine`` as
    ``self.engine``."""

    engine: AsyncEngine

    async def LoadLoRA(
        self, request: worker_pb2.LoadLoRARequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadLoRAResponse:
        engine = self.engine.engine
        try:
            lora = LoRARequest(
                request.lora_name,
                len(engine.list_loras()) + 1,  # the engine keys adapters by name
                request.lora_path,
                request.base_model_name or None,
            )
            added = await asyncio.to_thread(engine.add_lora, lora)
            # a command on the engine thread refreshes the load the heartbeat publishes
            namespace = await self.engine.call(lambda e: e.lora_namespace(lora.lora_name))
        except (ValueError, OSError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except KeyError as err:  # unloaded meanwhile
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]))
        return worker_pb2.LoadLoRAResponse(kv_namespace=namespace, added=added)

    async def UnloadLoRA(
        self, request: worker_pb2.UnloadLoRARequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadLoRAResponse:
        name, dry_run = request.lora_name, request.dry_run
        try:
            found = await self.engine.call(lambda e: e.remove_lora(name, dry_run=dry_run))
        except ValueError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return worker_pb2.UnloadLoRAResponse(found=found)
