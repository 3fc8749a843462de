"""The prefill unit's bootstrap server (prefill/decode disaggregation;
SGLang's bootstrap server): decode units claim bootstrap rooms here
(protos/bootstrap.proto). It runs in the core process on the bootstrap
port the gateway names in each request's ``disaggregated_params``.

A claim holds its gRPC thread until the engine answers it (the KV is in
the decode unit's pages, or the transfer failed): the handler hands a
``PendingClaim`` to the engine through ``ClaimInbox`` and waits. A call
the decode unit cancels (its request ended) marks the claim withdrawn and
the engine stops the transfer. At most ``max_claims`` calls at once; more
are refused RESOURCE_EXHAUSTED (the decode unit fails that request)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import structlog

from common.worker_token import TokenCheck
from protos import bootstrap_pb2 as bpb
from protos import bootstrap_pb2_grpc
from scheduler_service.engine.kv_sends import DecodePeer
from scheduler_service.engine.wakeup import Wakeup

logger = structlog.get_logger(__name__)


@dataclass(eq=False)
class PendingClaim:
    """A decode unit's claim of ``room``, waiting for the engine's answer."""

    room: int
    peer: DecodePeer
    prefix_len: int
    prompt_len: int
    page_size: int
    model: str
    at: float = 0.0  # when it arrived (the engine's clock)
    withdrawn: bool = False
    result: bpb.ClaimResult | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, result: bpb.ClaimResult) -> None:
        self.result = result
        self.done.set()

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message
        self.done.set()


class ClaimInbox:
    """New and withdrawn claims, from the server's threads to the engine's."""

    def __init__(self, wakeup: Wakeup) -> None:
        self._lock = threading.Lock()
        self._new: list[PendingClaim] = []
        self._wakeup = wakeup

    def put(self, claim: PendingClaim) -> None:
        with self._lock:
            self._new.append(claim)
        self._wakeup.set()

    def withdrawn(self, claim: PendingClaim) -> None:
        if claim.done.is_set():
            return
        claim.withdrawn = True
        self._wakeup.set()

    def take(self) -> list[PendingClaim]:
        with self._lock:
            new, self._new = self._new, []
        return new


class BootstrapServicer(bootstrap_pb2_grpc.BootstrapServicer):
    def __init__(self, inbox: ClaimInbox, token: str | None, wait_s: float) -> None:
        self._inbox = inbox
        self._token = TokenCheck(token) if token else None
        self._wait_s = wait_s

    def Claim(self, request: bpb.ClaimRequest, context: grpc.ServicerContext) -> bpb.ClaimResult:
        if self._token is not None and not self._token.accepts(context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid worker token")
        room = request.room
        if not request.targets or request.page_size <= 0 or request.prompt_len <= 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"room {room}: a claim names its workers, page size and prompt length",
            )
        claim = PendingClaim(
            room=room,
            peer=DecodePeer(tuple(request.targets), tuple(request.pages)),
            prefix_len=request.prefix_len,
            prompt_len=request.prompt_len,
            page_size=request.page_size,
            model=request.model,
        )
        context.add_callback(lambda: self._inbox.withdrawn(claim))
        self._inbox.put(claim)
        if not claim.done.wait(self._wait_s):
            self._inbox.withdrawn(claim)
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"room {room}: no answer from the prefill unit"
            )
        if claim.result is None:
            context.abort(claim.code, claim.message)
        return claim.result


def start_bootstrap_server(
    inbox: ClaimInbox, *, host: str, port: int, token: str | None, max_claims: int, wait_s: float
) -> tuple[grpc.Server, int]:
    """Serve the bootstrap service; the server and its bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_claims, thread_name_prefix="bootstrap"),
        maximum_concurrent_rpcs=max_claims,
    )
    bootstrap_pb2_grpc.add_BootstrapServicer_to_server(
        BootstrapServicer(inbox, token, wait_s), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the bootstrap port {host}:{port}")
    server.start()
    logger.info("bootstrap server started", host=host, port=bound)
    return server, bound


__all__ = ["BootstrapServicer", "ClaimInbox", "PendingClaim", "start_bootstrap_server"]
