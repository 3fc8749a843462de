"""The decode unit's engine side of disaggregation: each receive order of
the core (pages allocated and fenced) becomes a claim of its bootstrap
room at the prefill unit that the request's ``disaggregated_params`` name
(bootstrap_server.py there), with this unit's worker addresses per rank;
the claim's answer (the KV is in the pages, and the first token) is
reported ``received``, its refusal or loss ``failed``.

The core's cancels (the request was aborted or timed out) cancel the
claim, which makes the prefill unit stop its send; the pages are reported
free only ``DRAIN_S`` later, so that a batch already on its way into them
lands before they are reused."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grpc
import structlog

from common import worker_token
from protos import bootstrap_pb2 as bpb
from protos import bootstrap_pb2_grpc
from scheduler_service.core.disagg.coordinator import Disaggregation
from scheduler_service.core.disagg.orders import KvReceive
from scheduler_service.engine.bootstrap_codec import logprobs_from_proto
from scheduler_service.engine.wakeup import Wakeup

logger = structlog.get_logger(__name__)

DRAIN_S = 2.0  # after a cancelled claim, before its pages count as free


class DecodeTransfers:
    def __init__(
        self,
        disagg: Disaggregation,
        targets: Sequence[str],
        *,
        page_size: int,
        model: str,
        token: str | None,
        timeout_s: float,
        wakeup: Wakeup,
        clock: Callable[[], float],
    ) -> None:
        """``targets``: this unit's worker addresses per rank, as the prefill
        unit's workers reach them; ``timeout_s``: a claim's deadline."""
        self._d = disagg
        self._targets = list(targets)
        self._page_size = page_size
        self._model = model
        self._metadata = worker_token.metadata(token)
        self._timeout_s = timeout_s
        self._wakeup = wakeup
        self._clock = clock
        # Per prefill unit's bootstrap address: its channel and stub.
        self._channels: dict[str, tuple[grpc.Channel, bootstrap_pb2_grpc.BootstrapStub]] = {}
        self._lock = threading.Lock()
        self._live: dict[str, grpc.Future] = {}
        self._cancelled: set[str] = set()
        self._done: list[tuple[str, bpb.ClaimResult | None, str]] = []
        self._draining: list[tuple[float, str, str]] = []  # (free at, rid, message)

    def pump(self) -> None:
        d = self._d
        orders = d.take_orders()
        for order in orders.receives:
            self._claim(order)
        for rid in orders.cancels:
            with self._lock:
                future = self._live.get(rid)
                if future is not None:
                    self._cancelled.add(rid)
            if future is not None:
                future.cancel()
            else:
                d.failed(rid, "cancelled")
        with self._lock:
            done, self._done = self._done, []
        now = self._clock()
        for rid, result, error in done:
            if result is not None:
                d.received(
                    rid,
                    result.first_token,
                    logprobs_from_proto(result.logprobs) if result.HasField("logprobs") else None,
                    cached_tokens=result.cached_tokens,
                    grammar_ended=result.grammar_ended,
                )
            elif rid in self._cancelled:
                self._cancelled.discard(rid)
                self._draining.append((now + DRAIN_S, rid, error))
            else:
                d.failed(rid, error)
        if self._draining:
            due = [x for x in self._draining if x[0] <= now]
            self._draining = [x for x in self._draining if x[0] > now]
            for _, rid, error in due:
                d.failed(rid, error)

    def _claim(self, order: KvReceive) -> None:
        t = self._d.transfers.get(order.rid)
        bootstrap = t.req.bootstrap if t is not None else None
        if bootstrap is None:
            self._d.failed(order.rid, "no bootstrap address")
            return
        address = f"{bootstrap.host}:{bootstrap.port}"
        if address not in self._channels:
            channel = grpc.insecure_channel(address)
            self._channels[address] = (channel, bootstrap_pb2_grpc.BootstrapStub(channel))
        stub = self._channels[address][1]
        request = bpb.ClaimRequest(
            room=order.room,
            targets=self._targets,
            pages=order.pages,
            prefix_len=order.prefix_len,
            prompt_len=order.prompt_len,
            page_size=self._page_size,
            model=self._model,
        )
        future = stub.Claim.future(request, timeout=self._timeout_s, metadata=self._metadata)
        with self._lock:
            self._live[order.rid] = future
        future.add_done_callback(lambda f, rid=order.rid, a=address: self._answered(rid, a, f))

    def _answered(self, rid: str, address: str, future: grpc.Future) -> None:
        result: bpb.ClaimResult | None = None
        error = ""
        if future.cancelled():
            error = "cancelled"
        else:
            e = future.exception()
            if e is None:
                result = future.result()
            else:
                code = e.code() if isinstance(e, grpc.RpcError) else None  # type: ignore[attr-defined]
                details = e.details() if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]
                name = code.name if code else "error"
                error = f"the prefill unit at {address}: {name}: {details}"
        with self._lock:
            self._live.pop(rid, None)
            self._done.append((rid, result, error))
        self._wakeup.set()

    def close(self) -> None:
        with self._lock:
            futures = list(self._live.values())
        for f in futures:
            f.cancel()
        for channel, _ in self._channels.values():
            channel.close()


__all__ = ["DRAIN_S", "DecodeTransfers"]
