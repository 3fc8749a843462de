"""Disaggregation: the scheduler's disaggregated requests, from the moment
one announces itself until its transfer ends (SGLang's bootstrap, prealloc,
transfer and inflight queues, in one record per request: ``Transfer``).

The Scheduler builds one when ``SchedulerConfig.disaggregation_mode`` is set
and calls it at fixed points (announcement, step start and end, a first
token, a finish, worker loss, integrity); the engine reads its orders and
reports what the transfers did (orders.py). Every move of a request goes
through the request table; every finish through the scheduler's
``finish``, which asks ``on_finish`` whether the engine still holds the
request's pages (then they stay, as a *closing* transfer, until the engine
reports the transfer's end).

Prefill unit: BOOTSTRAPPING until the decode unit claims the room
(``peer_ready``), then an ordinary request with ``max_new_tokens`` 1; its
first token moves it to SENDING with a send order, and the decode unit's
acknowledgement (``sent``) finishes it, its pages going into the radix
cache. Decode unit: PREALLOC until pages fit (prealloc.py), RECEIVING with a
receive order once the plans in flight at allocation are answered;
``received`` delivers the first token and the request lands in the decode
batch at the end of the next step, its join carrying its table.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import structlog

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.disagg.integrity import check_disagg
from scheduler_service.core.disagg.orders import DisaggFigures, DisaggOrders, KvReceive, KvSend
from scheduler_service.core.disagg.prealloc import preallocate
from scheduler_service.core.disagg.transfer import (
    NEVER,
    TRANSFER_FAILED,
    Transfer,
    check_announced,
    prefill_sampling,
)
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import Join, ProtocolError, StepPlan, TokenLogprobs
from scheduler_service.core.request import FinishAbort, FinishReason, Place, Request
from scheduler_service.core.request_table import RequestTable
from scheduler_service.core.results import Receipt, StopStringChecker, receive_token

logger = structlog.get_logger(__name__)

Finish = Callable[[Request, FinishReason], None]


class Disaggregation:
    def __init__(
        self,
        config: SchedulerConfig,
        table: RequestTable,
        kv: KvManager,
        *,
        clock: Callable[[], float],
        inflight: deque[StepPlan],
        finish: Callable[..., None],
        emit: Callable[[RequestDelta], None],
        stats: SchedulerStats,
        stop_strings: StopStringChecker | None,
        start_decoding: Callable[[Request], None],
    ) -> None:
        """``finish(req, reason, emit=...)``: the scheduler's finish (it asks
        ``on_finish``); ``emit``: queue a delta for the client;
        ``start_decoding``: what the scheduler does for a request that
        starts decoding (its drafts), called with nothing in flight."""
        self.config = config
        self.mode = config.disaggregation_mode
        self.prefill = self.mode == "prefill"
        self._table = table
        self._kv = kv
        self._clock = clock
        self._inflight = inflight
        self._finish = finish
        self._emit = emit
        self._stats = stats
        self._stop_strings = stop_strings
        self._start_decoding = start_decoding
        # Every live request that announced itself, by rid, in announcement order.
        self.transfers: dict[str, Transfer] = {}
        self._rooms: dict[int, Transfer] = {}
        # Finished requests whose pages the engine still holds.
        self.closing: dict[str, Transfer] = {}
        self._orders = DisaggOrders()
        self._fenced: list[Transfer] = []  # decode: receive orders not yet handed over
        self._landing: list[Transfer] = []  # decode: received, joining the next plan

    # ============================================================ requests
    def announce(self, req: Request) -> None:
        """A new request with a bootstrap room (the table has not seen it):
        BOOTSTRAPPING on a prefill unit, PREALLOC on a decode unit."""
        check_announced(req, self._rooms)
        now = self._clock()
        req.times.arrival = req.times.queue_entry = now
        req.waits_for = None  # each sample is its own room; the prefix hold shares a prompt
        if self.prefill:
            prefill_sampling(req)
            req.speculative = False  # it samples one token
            to = Place.BOOTSTRAPPING
        else:
            # Its prompt's logprobs are the prefill unit's (the gateway takes them from there).
            req.prompt_logprobs_pending = False
            to = Place.PREALLOC
        t = Transfer(req, req.bootstrap.room, now + self.config.disaggregation_bootstrap_timeout_s)
        self._table.park(req, to)
        self.transfers[req.rid] = t
        self._rooms[t.room] = t

    def announced(self, room: int) -> Request | None:
        """The live request announced with ``room``, if any (the prefill
        engine matches decode units' claims with it)."""
        t = self._rooms.get(room)
        return t.req if t is not None else None

    def sends(self, req: Request) -> bool:
        """Whether ``req``'s first token starts a send (a prefill unit's request)."""
        return self.prefill and req.rid in self.transfers

    def reserved(self) -> list[Request]:
        """Requests that will join the decode batch without admission (a
        decode unit's preallocated ones): admission budgets them as running."""
        if self.prefill:
            return []
        return [t.req for t in self.transfers.values() if t.req.place is Place.RECEIVING]

    def take_orders(self) -> DisaggOrders:
        """The orders since the last call; a receive order once the plans in
        flight when its pages were allocated are answered."""
        if self._fenced:
            oldest = self._inflight[0].step_id if self._inflight else None
            due = [t for t in self._fenced if oldest is None or t.fence < oldest]
            if due:
                self._fenced = [t for t in self._fenced if t not in due]
                for t in due:
                    req = t.req
                    t.engine_holds = True
                    pages = tuple(req.pages[t.prefix_len // self._kv.page_size :].tolist())
                    self._orders.receives.append(
                        KvReceive(req.rid, t.room, pages, t.prefix_len, len(req.prompt_ids))
                    )
        orders, self._orders = self._orders, DisaggOrders()
        return orders

    # ========================================================= step hooks
    def step_start(self, new_token_ratio: float) -> None:
        """Before a step is planned: give up on peers past their deadline,
        and (decode unit) allocate pages for announced requests that fit."""
        now = self._clock()
        for t in [t for t in self.transfers.values() if t.deadline <= now]:
            self._expire(t)
        if self.prefill:
            return
        queue = [t.req for t in self.transfers.values() if t.req.place is Place.PREALLOC]
        if not queue:
            return
        taken = preallocate(
            self.config,
            self._kv,
            queue,
            running=list(self._table.running.values()),
            receiving=self.reserved(),
            new_token_ratio=new_token_ratio,
        )
        fence = self._inflight[-1].step_id if self._inflight else 0
        waiting = self.config.disaggregation_waiting_timeout_s
        for req in taken:
            t = self.transfers[req.rid]
            self._table.park(req, Place.RECEIVING)
            t.prefix_len = req.match_len
            t.fence = fence
            t.deadline = now + waiting
            self._fenced.append(t)

    def landing_due(self) -> bool:
        return bool(self._landing)

    def land(self, plan: StepPlan) -> None:
        """Decode unit, at the end of a step: the requests whose KV landed join
        the decode batch with this plan (their first decode is next step's).
        Their received pages enter the radix cache."""
        landing, self._landing = self._landing, []
        for t in landing:
            req = t.req
            del self.transfers[req.rid]
            del self._rooms[t.room]
            self._table.unpark(req, Place.RUNNING, self._clock())
            self._kv.cache_computed_prefix(req)
            self._start_decoding(req)
            logprobs = req.logprobs
            if logprobs.wants_prompt_logprobs:  # the prefill unit's
                logprobs = dataclasses.replace(logprobs, logprob_start_len=-1)
            plan.joins.append(
                Join(
                    req.rid,
                    req.sampling,
                    logprobs,
                    len(req.prompt_ids),
                    prefix_ids=list(req.prompt_ids),
                    num_output_tokens=len(req.output_ids),
                    trace_context=req.trace_context,
                    last_token=req.output_ids[-1],
                    kv_pages=req.pages.tolist(),
                )
            )

    def first_token(self, req: Request, reason: FinishReason, deltas: list[RequestDelta]) -> None:
        """Prefill unit: ``req``'s first token came back (and finished it, at
        max_new_tokens 1): it does not finish yet but sends its KV, and its
        delta carries the token without the finish."""
        t = self.transfers[req.rid]
        t.reason = reason
        for d in deltas:
            if d.req is req and d.finished:
                d.finished = d.plain = False
        self._table.park(req, Place.SENDING)
        t.deadline = self._clock() + self.config.disaggregation_waiting_timeout_s
        t.engine_holds = True
        pages = tuple(req.pages[t.prefix_len // self._kv.page_size :].tolist())
        lp = deltas_logprob(deltas, req)
        self._orders.sends.append(
            KvSend(
                req.rid,
                t.room,
                pages,
                t.prefix_len,
                len(req.prompt_ids),
                req.output_ids[0],
                lp,
                req.cached_tokens,
            )
        )

    # ======================================================= engine's news
    def peer_ready(self, rid: str, decode_prefix_len: int = 0) -> bool:
        """Prefill unit: the decode unit claimed ``rid``'s room, having
        ``decode_prefix_len`` tokens cached (page aligned): it may prefill.
        False if ``rid`` is not waiting for its peer (finished, stale)."""
        t = self.transfers.get(rid)
        if t is None or t.req.place is not Place.BOOTSTRAPPING:
            return False
        req = t.req
        ps = self._kv.page_size
        if decode_prefix_len % ps or not 0 <= decode_prefix_len < len(req.prompt_ids):
            self._fail(
                t,
                f"the decode unit reported {decode_prefix_len} cached tokens of a "
                f"{len(req.prompt_ids)}-token prompt, not a multiple of the page size {ps} "
                "below it (the units must share a page size)",
            )
            return True
        t.prefix_len = decode_prefix_len
        t.deadline = NEVER
        self._table.unpark(req, Place.WAITING, self._clock())
        return True

    def sent(self, rid: str) -> bool:
        """Prefill unit: the decode unit has ``rid``'s KV: it finishes, its
        pages going into the radix cache. False if nothing was being sent."""
        if self._close(rid):
            return True
        t = self.transfers.get(rid)
        if t is None or t.req.place is not Place.SENDING:
            return False
        self._forget(t)
        self._stats.disagg_sent += 1
        self._finish(t.req, t.reason)
        return True

    def received(
        self,
        rid: str,
        token: int,
        logprobs: TokenLogprobs | None = None,
        *,
        cached_tokens: int = 0,
        grammar_ended: bool = False,
    ) -> bool:
        """Decode unit: ``rid``'s KV and first token (sampled by the prefill
        unit, which read ``cached_tokens`` of the prompt from its cache)
        landed. The token is delivered now; the request decodes from the
        step after next (``land``), unless the token finished it."""
        if self._close(rid):
            return True
        t = self.transfers.get(rid)
        if t is None or t.req.place is not Place.RECEIVING or not t.engine_holds:
            return False
        req = t.req
        now = self._clock()
        t.engine_holds = False
        t.received = True
        t.deadline = NEVER
        self._stats.disagg_received += 1
        self._stats.prompt_tokens += len(req.prompt_ids)
        self._stats.cached_tokens += cached_tokens
        req.cached_tokens, req.cache_hits_counted = cached_tokens, True
        times = req.times
        times.first_scheduled = times.first_scheduled or now
        times.first_token = now
        receipt = Receipt(now, self.config.eos_token_ids, self._stop_strings)
        delta = RequestDelta(req, [], [])
        reason = receive_token(req, token, logprobs, delta, r=receipt, grammar_ended=grammar_ended)
        self._stats.generated_tokens += 1
        self._emit(delta)
        if reason is not None:
            self._forget(t)
            self._finish(req, reason, emit=False)  # its delta says so
        else:
            self._landing.append(t)
        return True

    def failed(self, rid: str, message: str) -> bool:
        """Either unit: ``rid``'s transfer (or its peer) failed and the engine
        is done with its pages: the request ends with ``message``."""
        if self._close(rid):
            return True
        t = self.transfers.get(rid)
        if t is None or t.received:
            return False
        t.engine_holds = False
        self._fail(t, f"KV transfer for bootstrap room {t.room} failed: {message}")
        return True

    # ============================================================ finishes
    def on_finish(self, req: Request, was: Place) -> bool:
        """``req`` finished while in ``was``: whether its pages stay (the
        engine still holds them: they go when it reports the transfer's end).
        Otherwise a decode unit's unfilled pages are made not to enter the
        cache, and the caller releases."""
        t = self.transfers.get(req.rid)
        if t is None:
            return False
        self._forget(t)
        if t.engine_holds:
            self.closing[req.rid] = t
            self._orders.cancels.append(req.rid)
            return True
        if was is Place.RECEIVING and not t.received:
            self._drop_unfilled(req)
        return False

    def worker_lost(self) -> None:
        """The worker group (and its pages) is gone, before the pool and the
        cache are dropped. A transfer in flight cannot finish: its request
        ends; a decode unit's request whose KV landed waits again and
        prefills here; closing transfers hold nothing any more."""
        for t in list(self.closing.values()):
            t.req.forget_kv()
        self.closing.clear()
        self._fenced.clear()
        self._landing.clear()
        for t in list(self.transfers.values()):
            req = t.req
            if req.place not in (Place.SENDING, Place.RECEIVING):
                continue
            req.forget_kv()
            if t.engine_holds:
                self._orders.cancels.append(req.rid)
            t.engine_holds = False
            if t.received:
                self._forget(t)
                self._table.unpark(req, Place.WAITING, self._clock())
                continue
            side = "prefill" if self.prefill else "decode"
            self._fail(t, f"the {side} worker was lost during the KV transfer of room {t.room}")

    # =========================================================== internals
    def _expire(self, t: Transfer) -> None:
        req = t.req
        if req.place in (Place.BOOTSTRAPPING, Place.PREALLOC):
            what = "claimed by the decode unit" if self.prefill else "given pages by this unit"
            timeout = self.config.disaggregation_bootstrap_timeout_s
        else:
            what = "acknowledged by the decode unit"
            if not self.prefill:
                what = "filled by the prefill unit"
            timeout = self.config.disaggregation_waiting_timeout_s
        logger.warning(
            "disaggregated request timed out", request_id=req.rid, room=t.room, place=req.place
        )
        self._fail(t, f"bootstrap room {t.room} was not {what} within {timeout:g} s")

    def _fail(self, t: Transfer, message: str) -> None:
        self._stats.disagg_failed += 1
        self._finish(t.req, FinishAbort(message, TRANSFER_FAILED))

    def _forget(self, t: Transfer) -> None:
        del self.transfers[t.req.rid]
        del self._rooms[t.room]
        if t in self._fenced:
            self._fenced.remove(t)
        if t in self._landing:
            self._landing.remove(t)

    def _close(self, rid: str) -> bool:
        """The engine ended a transfer the core had given up on: its pages go."""
        t = self.closing.pop(rid, None)
        if t is None:
            return False
        req = t.req
        if not self.prefill and not t.received:
            self._drop_unfilled(req)
        self._kv.release(req)
        return True

    def _drop_unfilled(self, req: Request) -> None:
        """A decode unit's pages past its cached prefix may hold anything:
        released, they go back to the pool, not into the cache."""
        req.kv_len = req.tree_pages * self._kv.page_size

    # ========================================================== reading
    def holders(self) -> list[Request]:
        """Requests off the worker that hold KV pages (integrity)."""
        held = [t.req for t in self.transfers.values() if t.req.place in _HOLDING]
        return held + [t.req for t in self.closing.values()]

    def busy(self) -> bool:
        """Pages wait for a transfer's end, or a landing for a plan."""
        return bool(self.closing or self._landing)

    def figures(self) -> DisaggFigures:
        counts = dict.fromkeys(_PARKED_NAMES, 0)
        for t in self.transfers.values():
            if t.req.place.value in counts:
                counts[t.req.place.value] += 1
        return DisaggFigures(self.mode, closing=len(self.closing), **counts)

    def check_integrity(self) -> None:
        check_disagg(
            self.mode,
            self._table,
            transfers=self.transfers,
            closing=self.closing,
            page_size=self._kv.page_size,
        )


_HOLDING = (Place.SENDING, Place.RECEIVING)
_PARKED_NAMES = ("bootstrapping", "sending", "prealloc", "receiving")


def deltas_logprob(deltas: list[RequestDelta], req: Request) -> TokenLogprobs | None:
    """The logprobs of ``req``'s first token among a result's deltas."""
    for d in deltas:
        if d.req is req and d.new_token_ids:
            if len(d.new_token_ids) != 1:
                raise ProtocolError(f"{req.rid}: {len(d.new_token_ids)} first tokens")
            return d.logprobs[0] if d.logprobs else None
    return None


__all__ = ["Disaggregation"]
