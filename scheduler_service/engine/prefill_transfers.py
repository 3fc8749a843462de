"""The prefill unit's engine side of disaggregation: decode units' claims
(bootstrap_server.py) meet the core's BOOTSTRAPPING requests by room, the
core's send orders go out as SendKv on every rank (kv_sends.py), and each
claim is answered with the first token once the KV landed, or refused.

Called by the loop after every step and every update (``pump``). Either
side may come first: a claim waits for its request up to the bootstrap
timeout (the gateway sends both at once), a request waits in the core
(BOOTSTRAPPING) for its claim."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog

from scheduler_service.core.disagg.coordinator import Disaggregation
from scheduler_service.core.disagg.orders import KvSend
from scheduler_service.core.request import Place
from scheduler_service.engine.bootstrap_codec import claim_result
from scheduler_service.engine.bootstrap_server import ClaimInbox, PendingClaim
from scheduler_service.engine.kv_sends import KvSendCarrier

logger = structlog.get_logger(__name__)


class PrefillTransfers:
    def __init__(
        self,
        disagg: Disaggregation,
        carrier: KvSendCarrier,
        inbox: ClaimInbox,
        *,
        page_size: int,
        model: str,
        clock: Callable[[], float],
        claim_ttl_s: float,
    ) -> None:
        self._d = disagg
        self._carrier = carrier
        self._inbox = inbox
        self._page_size = page_size
        self._model = model
        self._clock = clock
        self._ttl_s = claim_ttl_s
        self._unmatched: dict[int, PendingClaim] = {}  # room -> claim
        self._matched: dict[str, PendingClaim] = {}  # rid -> claim
        self._sending: dict[str, KvSend] = {}  # rid -> its order, while the carrier has it

    def pump(self) -> None:
        d = self._d
        now = self._clock()
        for claim in self._inbox.take():
            claim.at = now
            problem = self._refusal(claim)
            if problem:
                claim.refuse(grpc.StatusCode.FAILED_PRECONDITION, problem)
            elif claim.room in self._unmatched:
                claim.refuse(grpc.StatusCode.ALREADY_EXISTS, f"room {claim.room} is claimed")
            else:
                self._unmatched[claim.room] = claim
        if self._unmatched:
            self._match(now)
        orders = d.take_orders()
        for order in orders.sends:
            claim = self._matched.get(order.rid)
            if claim is None or claim.withdrawn:
                d.failed(order.rid, "the decode unit withdrew its claim")
                self._matched.pop(order.rid, None)
                continue
            self._sending[order.rid] = order
            self._carrier.start(order, claim.peer)
        for rid in orders.cancels:
            if rid in self._sending:
                self._carrier.cancel(rid)  # its end comes through take_done
            else:
                d.failed(rid, "cancelled")
            self._refuse(rid, grpc.StatusCode.ABORTED, "the prefill request ended")
        for rid, error in self._carrier.take_done():
            order = self._sending.pop(rid, None)
            claim = self._matched.pop(rid, None)
            if error is None and order is not None:
                d.sent(rid)
                if claim is not None:
                    claim.answer(claim_result(order))
            else:
                d.failed(rid, error or "the send ended without its order")
                if claim is not None:
                    claim.refuse(grpc.StatusCode.UNAVAILABLE, error or "the KV send failed")
        self._sweep_matched()

    def _refusal(self, claim: PendingClaim) -> str:
        if claim.page_size != self._page_size:
            return (
                f"room {claim.room}: the decode unit's page size is {claim.page_size}, this "
                f"prefill unit's {self._page_size} (the units must share a page size)"
            )
        if claim.model and self._model and claim.model != self._model:
            return (
                f"room {claim.room}: the decode unit serves {claim.model!r}, this prefill "
                f"unit {self._model!r}"
            )
        return ""

    def _match(self, now: float) -> None:
        d = self._d
        for room, claim in list(self._unmatched.items()):
            if claim.withdrawn:
                del self._unmatched[room]
                continue
            req = d.announced(room)
            if req is None:
                if now - claim.at >= self._ttl_s:
                    del self._unmatched[room]
                    claim.refuse(
                        grpc.StatusCode.NOT_FOUND,
                        f"room {room}: no prefill request announced it within {self._ttl_s:g} s",
                    )
                continue
            del self._unmatched[room]
            if req.place is not Place.BOOTSTRAPPING or req.rid in self._matched:
                claim.refuse(grpc.StatusCode.ALREADY_EXISTS, f"room {room} is claimed already")
                continue
            if len(claim.peer.pages) * self._page_size < len(req.prompt_ids) - claim.prefix_len:
                message = (
                    f"room {room}: the decode unit allocated {len(claim.peer.pages)} pages for "
                    f"{len(req.prompt_ids) - claim.prefix_len} tokens"
                )
                d.failed(req.rid, message)
                claim.refuse(grpc.StatusCode.FAILED_PRECONDITION, message)
                continue
            d.peer_ready(req.rid, claim.prefix_len)
            if req.rid in d.transfers:
                self._matched[req.rid] = claim
            else:  # peer_ready failed it (an unaligned prefix)
                claim.refuse(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"room {room}: the prefill unit refused the decode unit's cached prefix",
                )

    def _sweep_matched(self) -> None:
        """Withdrawn claims stop their sends; claims whose request ended
        before its send (aborted, timed out, its worker lost) are refused."""
        d = self._d
        for rid, claim in list(self._matched.items()):
            if rid in self._sending:
                if claim.withdrawn:
                    self._carrier.cancel(rid)
            elif claim.withdrawn:
                del self._matched[rid]
                d.failed(rid, "the decode unit withdrew its claim")
            elif rid not in d.transfers:
                self._refuse(rid, grpc.StatusCode.ABORTED, "the prefill request ended")

    def _refuse(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        claim = self._matched.get(rid)
        if claim is not None and rid not in self._sending:
            del self._matched[rid]
            claim.refuse(code, f"room {claim.room}: {message}")

    def close(self) -> None:
        """The core stops: every waiting claim is refused."""
        waiting = [*self._unmatched.values(), *self._matched.values(), *self._inbox.take()]
        for claim in waiting:
            claim.refuse(
                grpc.StatusCode.UNAVAILABLE, f"room {claim.room}: the prefill unit stopped"
            )


__all__ = ["PrefillTransfers"]
