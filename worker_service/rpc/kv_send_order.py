"""Worker.SendKv (prefill/decode disaggregation, the prefill side): the
engine's order to push pages of this worker's pool into another worker's
(its PushKv), run on the gRPC thread that took the call and answered once
every batch is acknowledged. The pages are a SENDING request's, which the
prefill scheduler keeps out of every plan until it reports the send, so
reading them beside a running step is safe."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog

from common.worker_token import read_token
from protos import worker_pb2 as pb
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_page_bytes import KvBytesError
from worker_service.rpc.kv_sender import KvTransferError, push_pages

logger = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class KvSendOrders:
    def __init__(self, kv: Callable[[], KvCache | None], token_file: str | None) -> None:
        """``token_file``: this worker's token, shown to the receiver (the
        units of one deployment share it)."""
        self._kv = kv
        self._token = read_token(token_file) if token_file else None

    def send(self, request: pb.SendKvRequest, context: grpc.ServicerContext) -> pb.SendKvResponse:
        kv = self._kv()
        if kv is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV pool")
        assert kv is not None
        room = request.room
        if len(request.src_pages) != len(request.dst_pages):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"room {room}: {len(request.src_pages)} source pages for "
                f"{len(request.dst_pages)} destination pages",
            )
        try:
            with grpc.insecure_channel(request.target) as channel:
                sent = push_pages(
                    channel,
                    room=room,
                    kv=kv,
                    src_pages=list(request.src_pages),
                    dst_pages=list(request.dst_pages),
                    token=self._token,
                    timeout_s=request.timeout_s or DEFAULT_TIMEOUT_S,
                    active=context.is_active,
                )
        except KvBytesError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {room}: {e}")
        except KvTransferError as e:
            logger.warning("kv send failed", room=room, target=request.target, error=str(e))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"to {request.target}: {e}")
        return pb.SendKvResponse(pages_sent=sent)
