"""Embed: one prefill-only request through the same core as Generate (queued,
admitted, chunked and batched with generation traffic, its prefix read from
the cache where its pooling allows), answered with its pooled vector; on a
sequence classifier, its labels' logits, and a rerank request's scores
(``is_cross_encoder``: the model's declared activation of them).

Errors are status codes as for Generate; a request the scheduler aborts
(out of memory, Abort) ends ABORTED with the scheduler's message.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api.convert.embed import embed_submission, pooling_of
from scheduler_service.api.convert.rerank import activate
from scheduler_service.api.core_client import CoreClient, CoreUnavailable, QueueFull
from scheduler_service.api.model_info import ModelContext
from scheduler_service.core.sampling import InvalidRequestError

logger = structlog.get_logger(__name__)


class EmbedRpc:
    def __init__(self, core: CoreClient, model: ModelContext, *, rid_grace_s: float) -> None:
        self.core = core
        self.model = model
        self.options = pooling_of(model.ready.worker_info)
        self.rid_grace_s = rid_grace_s

    async def embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        model = self.model
        try:
            sub = embed_submission(
                request,
                model.limits,
                model.encode,
                has_tokenizer=model.has_tokenizer,
                options=self.options,
                architecture=model.ready.architecture,
                scoring=model.scoring,
                encode_pair=model.encode_pair,
            )
            await self.core.wait_free([sub.rid], self.rid_grace_s)
            await self.core.wait_restart(1)
            call = self.core.submit([sub])
        except (InvalidRequestError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except CoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker can serve: {e}")
        try:
            vector = await self._vector(call, context)
        except (asyncio.CancelledError, GeneratorExit):
            self.core.abort(call.rids, "client disconnected")
            raise
        finally:
            self.core.forget(call)
        if request.is_cross_encoder:  # embed_submission refused it without a score head
            vector = activate(vector, model.scoring)
        return pb.EmbedResponse(
            embedding=vector, embedding_dim=len(vector), prompt_tokens=len(sub.prompt_ids)
        )

    @staticmethod
    async def _vector(call, context: grpc.aio.ServicerContext) -> list[float]:
        vector: list[float] | None = None
        while True:
            item = await call.queue.get()
            if isinstance(item, CoreUnavailable):
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker can serve: {item}")
            if isinstance(item, ipc.Rejected):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
            if item.embedding is not None:
                vector = item.embedding
            finish = item.finish
            if finish is None:
                continue
            if finish.kind == "abort":
                await context.abort(grpc.StatusCode.ABORTED, finish.message or "aborted")
            if vector is None:
                await context.abort(grpc.StatusCode.INTERNAL, "the worker returned no embedding")
            return vector
