"""The receiving side of the worker-to-worker KV transfer (Worker.PushKv,
prefill/decode disaggregation): batches of whole pages, checked (sequence,
layout, pages, crc32) and written into this worker's pool, each
acknowledged once written. The decode unit's scheduler named the pages and
keeps them from every plan until the transfer is reported (the core's
fence), so no step reads or writes them meanwhile."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import grpc
import structlog

from protos import worker_pb2 as pb
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_page_bytes import KvBytesError, bytes_per_page, write_pages

logger = structlog.get_logger(__name__)


class KvReceiver:
    def __init__(self, kv: Callable[[], KvCache | None]) -> None:
        """``kv``: this worker's pool (None: it has none, the simulated model)."""
        self._kv = kv

    def push(
        self, batches: Iterator[pb.KvBatch], context: grpc.ServicerContext
    ) -> Iterator[pb.KvAck]:
        kv = self._kv()
        if kv is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV pool")
        assert kv is not None
        try:
            per_page = bytes_per_page(kv)
        except KvBytesError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        room, written, expected = "", 0, 0
        for batch in batches:
            if expected == 0:
                room = batch.room
                if batch.bytes_per_page != per_page:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"room {room}: the sender's pages are {batch.bytes_per_page} bytes, "
                        f"this worker's {per_page} (not the same model, KV dtype, page size "
                        "or TP rank's heads)",
                    )
            if batch.seq != expected:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"room {room}: batch {batch.seq} where batch {expected} was due",
                )
            if zlib.crc32(batch.data) != batch.crc32:
                logger.warning("kv batch checksum mismatch", room=room, seq=batch.seq)
                context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"room {room}: batch {batch.seq} does not match its checksum",
                )
            try:
                write_pages(kv, batch.dst_pages, batch.data)
            except KvBytesError as e:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"room {room}: batch {batch.seq}: {e}"
                )
            written += len(batch.dst_pages)
            expected += 1
            yield pb.KvAck(seq=batch.seq, pages_written=written)
            if batch.last:
                logger.info("kv received", room=room, pages=written, batches=expected)
                return
        if expected:
            logger.warning("kv transfer ended before its last batch", room=room, pages=written)
