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

from common.worker_token import metadata, read_token
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_page_bytes import KvBytesError, check_pages
from worker_service.device.kv_shared_memory import SharedPool
from worker_service.rpc.kv_sender import KvTransferError, push_pages

logger = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class KvSendOrders:
    def __init__(self, kv: Callable[[], KvCache | None], token_file: str | None) -> None:
        """``token_file``: this worker's token, shown to the receiver (the
        units of one deployment share it)."""
        self._kv = kv
        self._token = read_token(token_file) if token_file else None
        self._pools: dict[str, SharedPool] = {}

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
                shared = self._shared_pool(channel, kv, request.target)
                if shared is not None:
                    check_pages(kv, request.src_pages)
                    shared.write(kv.layers, request.src_pages, request.dst_pages)
                    logger.info(
                        "kv copied in shared memory", room=room, pages=len(request.src_pages)
                    )
                    return pb.SendKvResponse(pages_sent=len(request.src_pages), shared_memory=True)
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
        except (KvBytesError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {room}: {e}")
        except KvTransferError as e:
            logger.warning("kv send failed", room=room, target=request.target, error=str(e))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"to {request.target}: {e}")
        return pb.SendKvResponse(pages_sent=sent)

    def _shared_pool(self, channel: grpc.Channel, kv: KvCache, target: str) -> SharedPool | None:
        """The receiver's pool if it is in shared memory this process can
        open (same host), with this pool's layout; None: stream instead."""
        if kv.device.type != "cpu" or kv.swa_layers:
            return None
        try:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(
                pb.GetInfoRequest(), metadata=metadata(self._token), timeout=10
            )
        except grpc.RpcError:
            return None  # the push reports what is wrong with the receiver
        path = info.kv_shared_memory
        if not path:
            return None
        pool = self._pools.get(path)
        if pool is None:
            layer_bytes = [layer[0].numel() * layer.element_size() for layer in kv.layers]
            pool = SharedPool.open(path, layer_bytes)
            if pool is None:
                logger.info("the receiver's shared KV pool is not reachable here", target=target)
                return None
            self._pools = {path: pool}  # the latest receiver's only: a restarted one has a new file
        return pool
