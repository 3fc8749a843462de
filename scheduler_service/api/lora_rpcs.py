"""LoadLoRAAdapter, UnloadLoRAAdapter, ListLoadedLoRAAdapters.

The core process owns the adapters (it loads them on every worker rank and
owns the worker's adapter slots); these RPCs pass the request on and answer
with its verdict. A refusal is a gRPC status (INVALID_ARGUMENT, NOT_FOUND,
ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNAVAILABLE) with
the reason; every answer lists the adapters loaded after it.
"""

from __future__ import annotations

import grpc
import structlog
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api.core_client import CoreClient, CoreUnavailable
from scheduler_service.core.adapters import ADAPTER_NAME

logger = structlog.get_logger(__name__)


class LoraRpcs:
    def __init__(self, core: CoreClient) -> None:
        self.core = core

    async def load(self, request: pb.LoadLoRAAdapterRequest, context) -> pb.LoadLoRAAdapterResponse:
        lora_id = request.lora_id
        name = request.lora_name or lora_id
        if not lora_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "lora_id is required (the caller mints it)"
            )
        for what, value in (("lora_id", lora_id), ("lora_name", name)):
            if not ADAPTER_NAME.match(value):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{what} {value!r}: use 1-64 characters of A-Z a-z 0-9 . _ -",
                )
        if not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path is required")
        reply = await self._ask(
            context,
            lambda token: ipc.LoadAdapter(token, lora_id, name, request.lora_path, request.pinned),
        )
        return pb.LoadLoRAAdapterResponse(
            success=True, message="", loaded_lora_ids=[a.lora_id for a in reply.adapters]
        )

    async def unload(
        self, request: pb.UnloadLoRAAdapterRequest, context
    ) -> pb.UnloadLoRAAdapterResponse:
        if not request.lora_name and not request.lora_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "give lora_name (and lora_id) of the adapter"
            )
        reply = await self._ask(
            context, lambda token: ipc.UnloadAdapter(token, request.lora_id, request.lora_name)
        )
        return pb.UnloadLoRAAdapterResponse(
            success=True, message="", loaded_lora_ids=[a.lora_id for a in reply.adapters]
        )

    async def list(self, request, context) -> pb.ListLoadedLoRAAdaptersResponse:
        return pb.ListLoadedLoRAAdaptersResponse(
            loaded_adapters=[
                pb.LoadedLoRAAdapter(
                    lora_id=a.lora_id, lora_name=a.name, lora_path=a.path, pinned=a.pinned
                )
                for a in self.core.adapters
            ]
        )

    async def _ask(self, context, make) -> ipc.AdapterReply:
        try:
            reply = await self.core.adapter_op(make)
        except CoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not reply.ok:
            await context.abort(grpc.StatusCode[reply.code], reply.message)
        return reply
