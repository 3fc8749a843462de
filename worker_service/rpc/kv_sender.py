"""The sending side of the worker-to-worker KV transfer (Worker.PushKv on
the receiving worker; prefill/decode disaggregation): pages of this
worker's pool streamed in batches of whole pages with a crc32 each, at most
``window`` batches unacknowledged. Under tensor parallelism rank r sends its
own heads' shard to rank r of the decode unit. Any failure (the receiver
refusing, gone, or silent past the timeout) raises ``KvTransferError``
naming the room and the receiver."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator, Sequence

import grpc
import structlog

from common.worker_token import metadata
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_page_bytes import bytes_per_page, check_pages, read_pages

logger = structlog.get_logger(__name__)

PAGES_PER_BATCH = 16
WINDOW = 4


class KvTransferError(RuntimeError):
    pass


def push_pages(
    channel: grpc.Channel,
    *,
    room: str,
    kv: KvCache,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    token: str | None = None,
    pages_per_batch: int = PAGES_PER_BATCH,
    window: int = WINDOW,
    timeout_s: float = 60.0,
    active: Callable[[], bool] = lambda: True,
) -> int:
    """Send ``src_pages`` of ``kv`` into the receiver's ``dst_pages`` (in
    order); returns the pages written once every batch is acknowledged.
    ``active`` False (the order was cancelled) stops before the next batch."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    per_page = bytes_per_page(kv)
    check_pages(kv, src_pages)  # KvBytesError before anything is sent
    starts = list(range(0, len(src_pages), pages_per_batch)) or [0]
    credits = threading.Semaphore(window)
    stop = threading.Event()

    def batches() -> Iterator[pb.KvBatch]:
        for seq, at in enumerate(starts):
            while not credits.acquire(timeout=0.05):
                if stop.is_set() or not active():
                    return
            if not active():
                return
            data = read_pages(kv, src_pages[at : at + pages_per_batch])
            yield pb.KvBatch(
                room=room if seq == 0 else "",
                bytes_per_page=per_page if seq == 0 else 0,
                seq=seq,
                dst_pages=dst_pages[at : at + pages_per_batch],
                data=data,
                crc32=zlib.crc32(data),
                last=seq == len(starts) - 1,
            )

    stub = worker_pb2_grpc.WorkerStub(channel)
    acked = written = 0
    try:
        for ack in stub.PushKv(batches(), metadata=metadata(token), timeout=timeout_s):
            if ack.seq != acked:
                raise KvTransferError(f"room {room}: ack for batch {ack.seq}, {acked} was due")
            acked += 1
            written = ack.pages_written
            credits.release()
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        raise KvTransferError(
            f"room {room}: the KV transfer failed after {acked} of {len(starts)} batches: "
            f"{code.name if code else 'UNKNOWN'}: {e.details()}"  # type: ignore[attr-defined]
        ) from e
    finally:
        stop.set()
    if acked != len(starts):
        raise KvTransferError(
            f"room {room}: the receiver ended the transfer after {acked} of {len(starts)} batches"
        )
    logger.info("kv sent", room=room, pages=written, batches=acked)
    return written
