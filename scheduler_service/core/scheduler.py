"""The Scheduler: ``step() -> StepPlan`` and ``update(StepResult)``.

It owns every request's place (the request table; the waiting queue; n > 1
siblings held until their shared prompt is planned; the running batch; the
request whose prefill is chunked; the plans in flight) and makes every move
between them. Its collaborators decide and report: intake.py checks new
requests and releases held siblings, admission (admission.py) says which
waiting requests run and which running ones are preempted, the running batch
(batch.py) says which requests must give up their KV for a decode to fit,
decode_schedule.py makes the decode rows and moves the new-token ratio,
oom_aborts.py says which request cannot fit at all, prefill_entries.py turns
admissions into plan entries, results.py says what a result means for each
request and which finished, worker_loss.py what a lost worker group means
for each; the KV manager (kv_manager.py) owns pages.

Each step is a prefill (admit waiting requests, continue a chunked one),
optionally mixed with the decode batch, or else a decode of the running
batch (retracting requests when pages run out), as in SGLang.

Overlap: ``step()`` for N+1 may run before ``update()`` for N. Decode entries
then name "the last sampled token", in-flight tokens are counted in
``Request.pending``, and results are matched to the request *epoch* they were
planned for: a request retracted, preempted or finished since has its late
token discarded (a finished one's extra step only wrote a page that is freed).

Speculative decoding (spec_plan.py, spec_state.py, drafts.py): a running
request that drafts gets an extend entry of its last token plus the drafts.
Drafting needs that last token, so when a request wants drafts while plans
are in flight, ``step()`` returns None until they are answered (the pipeline
drains); while a drafted plan is in flight, nothing else is planned.
Requests that do not draft keep the overlap.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import structlog

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.admission.decision import plan_admission
from scheduler_service.core.admission.entries import plan_prefill
from scheduler_service.core.admission.policy import SchedulePolicy
from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode_schedule import (
    decode_rows,
    expect_decodes,
    next_new_token_ratio,
    start_decoding,
)
from scheduler_service.core.finish import StopStringChecker
from scheduler_service.core.inflight import InFlight, ProtocolError, take_answered
from scheduler_service.core.intake import check_new_request, leader_planned, release_held
from scheduler_service.core.integrity import check_scheduler_integrity
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.oom_aborts import oom_after_retraction, unfit_head
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import (
    ForwardMode,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from scheduler_service.core.request import (
    FinishAbort,
    FinishLength,
    FinishReason,
    Request,
    RequestState,
)
from scheduler_service.core.results import apply_result
from scheduler_service.core.spec.drafts import Drafter, NgramDrafter
from scheduler_service.core.spec.rows import Drafts, DraftWatch
from scheduler_service.core.spec.settle import settle_drafts
from scheduler_service.core.worker_loss import (
    forget_cache_reads,
    send_back_to_wait,
    take_kv_holders,
)

logger = structlog.get_logger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_pages: int,
        stop_strings: StopStringChecker | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
    ) -> None:
        """``drafter``: the draft source when ``config.speculative_ngram`` is on
        (default: the n-gram sources of drafts.py; tests inject their own)."""
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.cache = RadixCache(config.page_size, self.pool, enable_events=config.enable_kv_events)
        self.kv = KvManager(self.pool, self.cache)
        self.policy = SchedulePolicy(config, self.cache)
        self.adapters = AdapterSlots(config.max_loaded_loras, config.max_loras_per_batch)
        # Where each live request is: exactly one of these (check_integrity).
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.held: list[Request] = []  # n > 1 siblings, until their leader is planned
        self.running = RunningBatch(self.kv)
        self.chunked: Request | None = None
        self._inflight: deque[InFlight] = deque()  # plans sent, oldest first
        self.new_token_ratio = config.start_new_token_ratio
        self.stats = SchedulerStats()
        self._stop_strings = stop_strings
        self._clock = clock
        self._step_id = 0
        self._departures: list[str] = []  # rids whose worker state the next plan drops
        self._outbox: list[RequestDelta] = []
        self._admission_stuck = False
        self._drafter: Drafter | None = None
        self._watch: DraftWatch | None = None
        if config.speculative_ngram:
            self._drafter = drafter if drafter is not None else NgramDrafter(self.cache)
            self._watch = DraftWatch(self._drafter, config.context_len)
        self._drafting = False  # this step may draft (nothing in flight)
        # Told (request, "retraction" | "preemption" | "worker loss") whenever
        # a request is sent back to wait; the service's tracing listens.
        self.on_requeue: Callable[[Request, str], None] | None = None

    # ============================================================ requests
    def add_request(self, req: Request) -> None:
        """Queue a request; raise InvalidRequestError if it can never run.
        A request that ``waits_for`` a live sibling is held until that
        sibling's prompt is planned (and so cached)."""
        check_new_request(req, self.requests, self.config, self.adapters, self.pool)
        now = self._clock()
        req.times.arrival = req.times.queue_entry = now
        self.requests[req.rid] = req
        if req.waits_for is not None and not leader_planned(req, self.requests):
            self.held.append(req)
        else:
            req.waits_for = None
            self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted by the client", emit: bool = True) -> bool:
        """Finish a live request at once, freeing its pages; False if unknown.
        ``emit=False``: the caller tells the client itself (no finish delta)."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._finish(req, FinishAbort(message), emit=emit)
        return True

    def drain(self) -> list[RequestDelta]:
        """Token deltas and finishes since the last call, in order."""
        out, self._outbox = self._outbox, []
        return out

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_idle(self) -> bool:
        return not (self.requests or self._inflight or self._departures)

    # ================================================================ step
    def step(self) -> StepPlan | None:
        """Plan the next forward; None when there is nothing to send (or when
        plans in flight must be answered first: speculative decoding)."""
        inflight = self._inflight
        if inflight and inflight[-1].drafts:
            return None  # a drafted plan: its result decides what comes next
        self._drafting = False
        limit = self.config.speculative_disable_by_batch_size
        if (
            self._watch is not None
            and (not limit or len(self.running) <= limit)
            and self._watch.wants(self.running, self._step_id)
        ):
            if inflight:
                self.stats.spec_drains += 1
                return None  # drain: drafts need the last sampled tokens
            self._drafting = True
        if self.held:
            self.held = release_held(self.held, self.requests, self.waiting, self._clock)
        mixed = self.config.enable_mixed_chunk and len(self.running) > 0
        decode_reqs = self.running.decode_candidates() if mixed else []
        prefill = self._schedule_prefill(len(decode_reqs))
        drafts: Drafts = {}
        if not prefill:
            decode_entries, drafts = self._schedule_decode()
            if not decode_entries:
                return self._idle_plan()
            mode = ForwardMode.DECODE
            if drafts:
                mode = (
                    ForwardMode.MIXED if len(drafts) < len(decode_entries) else ForwardMode.PREFILL
                )
            plan = StepPlan(self._next_step_id(), mode, departures=self._depart_now())
            record = InFlight(plan.step_id, {}, 0)
            self.stats.decode_steps += 1
        else:
            plan = StepPlan(
                self._next_step_id(), ForwardMode.PREFILL, departures=self._depart_now()
            )
            record = InFlight(plan.step_id, {}, 0)
            for req in plan_prefill(prefill, plan, record, self.kv, self._clock(), self.stats):
                start_decoding(
                    req, self.running, self._drafter, self._watch, self.config.speculative_max_draft
                )
            # Decode the batch in the same forward if its pages fit after the
            # prefill's (requests preempted for the prefill are gone).
            decode_reqs = [r for r in decode_reqs if r.state is RequestState.DECODING]
            decode_entries = []
            if decode_reqs and self.running.pages_needed(decode_reqs) <= self.kv.available_pages():
                decode_entries, drafts = self._decode_rows(decode_reqs)
                plan.mode = ForwardMode.MIXED
                self.stats.mixed_steps += 1
            else:
                self.stats.prefill_steps += 1
        plan.entries.extend(decode_entries)
        if self.adapters.changed:
            plan.adapter_slots = self.adapters.take_changes()
        expect_decodes(record, plan, decode_entries, drafts, self.requests, self.stats)
        self._inflight.append(record)
        self.stats.steps += 1
        return plan

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _depart_now(self) -> list[str]:
        departures, self._departures = self._departures, []
        return departures

    def _idle_plan(self) -> StepPlan | None:
        if not self.running and not self.waiting and self.chunked is None:
            self.new_token_ratio = self.config.start_new_token_ratio
        self._abort_unschedulable()
        if not self._departures:
            return None
        plan = StepPlan(self._next_step_id(), ForwardMode.IDLE, departures=self._depart_now())
        self._inflight.append(InFlight(plan.step_id, {}, 0))
        return plan

    # ------------------------------------------------------------- prefill
    def _schedule_prefill(self, mixed_tokens: int) -> list[tuple[Request, int]]:
        """Admit what the budgets allow and apply the decision."""
        cfg = self.config
        self._admission_stuck = False
        if not self.waiting and self.chunked is None:
            return []
        full = len(self.running) >= cfg.max_running_requests and self.chunked is None
        if full and not cfg.enable_priority_scheduling:
            return []
        if self.waiting:
            self.policy.order(self.waiting, self.running, self._clock())
        decision = plan_admission(
            cfg,
            self.kv,
            self.waiting,
            self.running.reqs(),
            self.chunked,
            self.new_token_ratio,
            mixed_tokens,
            self.adapters,
        )
        self._admission_stuck = decision.stuck
        if decision.admitted:
            taken = {id(r) for r, _ in decision.admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        for req in decision.preempted:
            self.running.remove(req)
            self._requeue(req, "preemption")
            req.preemptions += 1
            self.stats.preemptions += 1
            self.waiting.append(req)
        self.chunked = decision.chunked
        return decision.admitted

    def _abort_unschedulable(self) -> None:
        """Abort the request first in line if it cannot fit even in an empty
        pool (oom_aborts.unfit_head): only when nothing runs, nothing is in
        flight and admission was stuck."""
        if self.running or self._inflight or not self._admission_stuck:
            return
        unfit = unfit_head(self.chunked, self.waiting, self.pool)
        if unfit is not None:
            self._finish(*unfit)
            self.stats.oom_aborts += 1

    # -------------------------------------------------------------- decode
    def _decode_rows(self, reqs: list[Request]) -> tuple[list[ScheduledRequest], Drafts]:
        drafter = self._drafter if self._drafting else None
        return decode_rows(
            self.running, self.kv, reqs, drafter, self._step_id, self.config.context_len
        )

    def _schedule_decode(self) -> tuple[list[ScheduledRequest], Drafts]:
        """Decode the running batch, retracting requests when pages run out."""
        if not self.running:
            return [], {}
        candidates = self.running.decode_candidates()
        room = self.running.make_room_for_decode(candidates, self.chunked, bool(self._inflight))
        for req in room.retracted:
            self.running.remove(req)
            self._retracted(req)
            self.waiting.append(req)
        if room.chunked_released:
            req, self.chunked = self.chunked, None
            self._retracted(req)
            self.waiting.insert(0, req)
        for req in room.out_of_memory:
            self.stats.oom_aborts += 1
            self._finish(req, oom_after_retraction(req))
        self.new_token_ratio = next_new_token_ratio(
            self.config, self.new_token_ratio, self.running, len(room.retracted)
        )
        if not room.ready:
            return [], {}
        if room.retracted:  # otherwise the batch, and so its candidates, did not change
            candidates = self.running.decode_candidates()
        return self._decode_rows(candidates) if candidates else ([], {})

    # ============================================================== update
    def update(self, result: StepResult) -> None:
        """Apply the worker's result for the oldest plan in flight."""
        record = take_answered(self._inflight, result.step_id)
        finished = apply_result(
            record,
            result,
            self._clock(),
            self.stats,
            self._outbox,
            self.config.eos_token_ids,
            self._stop_strings,
        )
        if record.drafts:
            settle_drafts(record.drafts, self.kv, self._step_id)
        for req, reason in finished:
            self._finish(req, reason, emit=False)  # its delta says it finished
        for req, epoch in record.prefill_only:
            if req.epoch == epoch:
                self._finish(req, FinishLength(req.sampling.max_new_tokens))

    # =============================================================== moves
    def _depart(self, req: Request) -> None:
        """The next plan tells the worker to drop ``req``'s state."""
        if req.on_worker:
            self._departures.append(req.rid)
            req.on_worker = False
        if req.adapter_slot:
            self.adapters.release(req.adapter_slot)
            req.adapter_slot = 0

    def _requeue(self, req: Request, why: str) -> None:
        """Turn a request whose KV was released into one waiting again (the
        caller takes it out of where it was and puts it in the queue)."""
        self._depart(req)
        req.back_to_wait(self._clock())
        if self.on_requeue is not None:
            self.on_requeue(req, why)

    def _retracted(self, req: Request) -> None:
        self._requeue(req, "retraction")
        req.retractions += 1
        self.stats.retractions += 1

    def _finish(self, req: Request, reason: FinishReason, emit: bool = True) -> None:
        """Finish ``req`` wherever it is, cache its tokens and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req.waits_for is not None:
            self.held.remove(req)
        elif req.state in (RequestState.WAITING, RequestState.RETRACTED):
            self.waiting.remove(req)
        self.kv.release(req, cache_tokens=True)
        self._depart(req)
        if req.spec is not None:  # its n-gram index and cache cursor
            req.spec.lookup = req.spec.radix_cont = None
        req.finish(reason, self._clock())
        del self.requests[req.rid]
        kinds = self.stats.finished
        kinds[reason.kind] = kinds.get(reason.kind, 0) + 1
        if emit:
            self._outbox.append(RequestDelta(req, [], finished=True))

    # ========================================================= worker loss
    def reset_after_worker_loss(self, num_pages: int | None = None) -> list[Request]:
        """The worker group was lost with its KV pages, but every request's
        tokens are here: drop the radix cache, the page pool's state and the
        plans in flight, and send every request that holds KV back to wait
        with the output it has, exactly like a retracted one. Tokens that were
        in flight are sampled again on the same context, and nothing is
        delivered twice (deliveries only come from ``update()``).

        ``num_pages``: the pool size of the worker group that came back (None:
        unchanged). Safe to call again while nothing ran in between. Returns
        the requests sent back to wait.
        """
        holders = take_kv_holders(self.running, self.chunked, self._inflight)
        self.chunked = None
        send_back_to_wait(holders, self.waiting, self._clock())
        forget_cache_reads(self.waiting, self.requests, self.stats)
        self._inflight.clear()
        self._departures.clear()  # the new worker holds no request state to drop
        self.adapters.reset()  # and no adapter in its slots
        self._admission_stuck = False
        self.cache.reset()  # emits AllBlocksCleared for the cache-aware router
        self.pool.reset(num_pages)
        self.stats.worker_losses += 1
        self.stats.worker_loss_requeues += len(holders)
        if self.on_requeue is not None:
            for req in holders:
                self.on_requeue(req, "worker loss")
        logger.info(
            "worker state dropped",
            requeued=len(holders),
            waiting=len(self.waiting),
            num_pages=self.pool.num_pages,
        )
        return holders

    def resize_pool(self, num_pages: int) -> None:
        """Take the page count of the worker group that came back; only while
        nothing holds KV (between reset_after_worker_loss and the next step)."""
        if self.pool.num_free != self.pool.num_pages or self.cache.cached_pages or self._inflight:
            raise RuntimeError("the page pool can only be resized while it is empty")
        self.pool.reset(num_pages)

    # ========================================================== invariants
    def check_integrity(self) -> None:
        """Every page is exactly one of free, cached-unlocked, or held (by a
        request's own pages or a locked cache node); every live request is in
        exactly one place, in a state that fits it."""
        check_scheduler_integrity(
            self.kv,
            self.requests,
            self.waiting,
            self.held,
            self.running,
            self.chunked,
            self._inflight,
        )
        self.adapters.check_integrity(
            (r.rid, r.adapter, r.adapter_slot) for r in self.requests.values()
        )

    def requests_of_adapter(self, lora_id: str) -> int:
        """Live requests (waiting or running) that use adapter ``lora_id``."""
        return sum(r.adapter == lora_id for r in self.requests.values())


__all__ = ["ProtocolError", "Scheduler"]
