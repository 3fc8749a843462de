"""The prefill unit's engine side of a KV send (prefill/decode
disaggregation): a core ``KvSend`` becomes one ``Worker.SendKv`` per rank
(rank r's pages to rank r of the decode unit, the pages the decode unit's
``KvReceive`` named), all in flight at once as gRPC futures, so the step
loop never waits on them. The engine polls ``take_done()`` and reports
each send's end to the core: ``sent(rid)`` when every rank answered,
``failed(rid, message)`` when any failed or it was cancelled.

Not yet wired: who gives ``start`` the decode unit's addresses and pages is
the bootstrap handshake (docs/design.md, Prefill/decode disaggregation)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from common import worker_token
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.core.disagg.orders import KvSend

logger = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DecodePeer:
    """Where a room's KV goes: the decode unit's worker address per rank and
    the pages its ``KvReceive`` named (as many as the send's)."""

    targets: tuple[str, ...]
    pages: tuple[int, ...]


@dataclass(slots=True)
class _Send:
    rid: str
    room: int
    futures: list[grpc.Future] = field(default_factory=list)
    left: int = 0
    error: str = ""


class KvSendCarrier:
    def __init__(
        self,
        stubs: Sequence[worker_pb2_grpc.WorkerStub],
        token: str | None = None,
        timeout_s: float = 60.0,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """``stubs``: this unit's workers, rank order; ``on_done``: called
        (from a gRPC thread) whenever a send ended."""
        self._stubs = list(stubs)
        self._metadata = worker_token.metadata(token)
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._lock = threading.Lock()
        self._live: dict[str, _Send] = {}
        self._done: list[tuple[str, str | None]] = []

    def start(self, order: KvSend, peer: DecodePeer) -> None:
        """Send ``order``'s pages to ``peer`` on every rank."""
        rid = order.rid
        problem = ""
        if len(peer.targets) != len(self._stubs):
            problem = f"{len(peer.targets)} decode ranks for {len(self._stubs)} prefill ranks"
        elif len(peer.pages) != len(order.pages):
            problem = f"{len(peer.pages)} decode pages for {len(order.pages)} pages to send"
        if problem:
            with self._lock:
                self._done.append((rid, f"room {order.room}: {problem}"))
            if self._on_done is not None:
                self._on_done()
            return
        send = _Send(rid, order.room, left=len(self._stubs))
        with self._lock:
            self._live[rid] = send
        for stub, target in zip(self._stubs, peer.targets, strict=True):
            request = pb.SendKvRequest(
                room=str(order.room),
                src_pages=order.pages,
                target=target,
                dst_pages=peer.pages,
                timeout_s=self._timeout_s,
            )
            future = stub.SendKv.future(
                request, timeout=self._timeout_s + 5, metadata=self._metadata
            )
            send.futures.append(future)
            future.add_done_callback(lambda f, s=send: self._answered(s, f))

    def _answered(self, send: _Send, future: grpc.Future) -> None:
        error = ""
        if future.cancelled():
            error = "cancelled"
        else:
            e = future.exception()
            if e is not None:
                details = e.details() if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]
                error = details or type(e).__name__
        stop: list[grpc.Future] = []
        ended = False
        with self._lock:
            if error and not send.error:
                send.error = error
                stop = [f for f in send.futures if f is not future]
            send.left -= 1
            if send.left == 0 and self._live.pop(send.rid, None) is send:
                message = f"room {send.room}: KV send failed: {send.error}" if send.error else None
                if message:
                    logger.warning("kv send failed", rid=send.rid, room=send.room, error=send.error)
                self._done.append((send.rid, message))
                ended = True
        if ended and self._on_done is not None:
            self._on_done()
        for other in stop:  # outside the lock: a cancel may call back at once
            other.cancel()

    def cancel(self, rid: str) -> None:
        """The core gave up on ``rid``: end its calls (reported failed)."""
        with self._lock:
            send = self._live.get(rid)
            futures = list(send.futures) if send is not None else []
        for f in futures:
            f.cancel()

    def take_done(self) -> list[tuple[str, str | None]]:
        """(rid, None: sent | the failure's message) of the sends that ended."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)
