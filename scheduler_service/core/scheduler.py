"""The Scheduler: ``step() -> StepPlan`` and ``update(StepResult)``.

It plans; where each request is belongs to the request table
(request_table.py), the only code that moves one. Each step the scheduler
asks its deciders (admission/, decode.py, results.py, worker_loss.py) and
applies their answers through the table; the KV manager (kv/) owns pages,
AdapterSlots the worker's adapter slots. Each step is a prefill (admit
waiting requests, continue a chunked one), optionally mixed with the decode
batch, or else a decode of the running batch, as in SGLang.

Overlap: ``step()`` for N+1 may run before ``update()`` for N. Decode entries
name "the last sampled token", in-flight tokens are counted in
``Request.pending``, and each plan entry remembers the request epoch it was
planned for, so a late token of a request that moved on is discarded. The
plans in flight are kept here, once (``in_flight``). Speculative decoding
(spec/): a request drafts only with nothing of it in flight, so ``step()``
returns None while the pipeline drains for drafts, and nothing else is
planned while a drafted plan is in flight.

The engine uses only ``ENGINE_INTERFACE`` (tests/test_architecture.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import structlog

from scheduler_service.core.adapters import Adapter, AdapterSlots
from scheduler_service.core.admission.decision import plan_admission, unfit_head
from scheduler_service.core.admission.entries import prefill_part
from scheduler_service.core.admission.policy import SchedulePolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode import (
    decode_candidates,
    decode_rows,
    make_room,
    next_new_token_ratio,
    oom_after_retraction,
    pages_needed,
    start_decoding,
)
from scheduler_service.core.disagg.coordinator import Disaggregation
from scheduler_service.core.intake import Submission, check_new_request, leader_planned
from scheduler_service.core.integrity import check_scheduler_integrity
from scheduler_service.core.kv.hicache_setup import build_hicache
from scheduler_service.core.kv.hiradix_cache import HiRadixCache
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.kv.sliding import SlidingPages
from scheduler_service.core.outputs import LoadFigures, RequestDelta, SchedulerStats, load_figures
from scheduler_service.core.plan import ForwardMode, PlanEntry, ProtocolError, StepPlan, StepResult
from scheduler_service.core.request import (
    WORKER_LOST,
    FinishAbort,
    FinishLength,
    FinishReason,
    Place,
    Request,
)
from scheduler_service.core.request_table import RequestTable
from scheduler_service.core.results import StopStringChecker, apply_result
from scheduler_service.core.spec.drafts import Drafter, NgramDrafter
from scheduler_service.core.spec.rows import DraftWatch
from scheduler_service.core.spec.settle import settle_drafts
from scheduler_service.core.worker_loss import (
    forget_cache_reads,
    forget_worker_state,
    resize_pools,
)

logger = structlog.get_logger(__name__)

# What the engine may use of a Scheduler (tests/test_architecture.py).
ENGINE_INTERFACE = frozenset(
    [
        "config",
        "stats",
        "on_requeue",
        "submit",
        "abort",
        "abort_adapter_requests",
        "drain",
        "step",
        "update",
        "in_flight",
        "rids_in_plan",
        "is_idle",
        "live_rids",
        "find",
        "table_sizes",
        "kv_snapshot",
        "load_figures",
        "take_kv_events",
        "flush_cache",
        "note_stored_blocks",
        "loaded_adapters",
        "check_adapter",
        "register_adapter",
        "unregister_adapter",
        "requests_of_adapter",
        "reset_after_worker_loss",
        "resize_pool",
        "check_integrity",
        "disagg",
    ]
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_pages: int,
        *,
        stop_strings: StopStringChecker | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
        num_swa_pages: int = 0,
        swa_window: int = 0,
    ) -> None:
        """``drafter``: the draft source when ``config.speculative_ngram`` is on
        (default: the n-gram sources of spec/drafts.py; tests inject their own).
        ``num_swa_pages``, ``swa_window``: the worker's sliding pool and its
        layers' window (WorkerInfo; 0: one pool, kv/sliding.py)."""
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.sliding: SlidingPages | None = None
        if num_swa_pages > 0:
            if swa_window <= 0:
                raise ValueError("a sliding pool needs the sliding layers' window")
            self.sliding = SlidingPages(num_swa_pages, config.page_size, swa_window)
        # The host tier (kv/hiradix_cache.py) and its file tier: None when off.
        self.hicache: HiRadixCache | None = build_hicache(
            config, self.pool, sliding=self.sliding is not None, clock=clock
        )
        self.cache = self.hicache or RadixCache(
            config.page_size,
            self.pool,
            enable_events=config.enable_kv_events,
            sliding=self.sliding,
        )
        self.kv = KvManager(self.pool, self.cache, self.sliding)
        self.policy = SchedulePolicy(config, self.cache)
        self.adapters = AdapterSlots(config.max_loaded_loras, config.max_loras_per_batch)
        self.table = RequestTable(self.adapters)
        self._inflight: deque[StepPlan] = deque()  # plans sent, oldest first
        self.new_token_ratio = config.start_new_token_ratio
        self.stats = SchedulerStats()
        self._stop_strings = stop_strings
        self._clock = clock
        self._step_id = 0
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
        # Prefill/decode disaggregation (core/disagg/; the engine reads its
        # orders and reports its transfers): None when the unit serves alone.
        self.disagg: Disaggregation | None = None
        if config.disaggregation_mode is not None:
            if self.sliding is not None or self.hicache is not None:
                raise ValueError("disaggregation serves no sliding-window model, no host tier yet")
            self.disagg = Disaggregation(
                config,
                self.table,
                self.kv,
                clock=clock,
                inflight=self._inflight,
                finish=self._finish,
                emit=lambda delta: self._outbox.append(delta),
                stats=self.stats,
                stop_strings=stop_strings,
                start_decoding=self._start_decoding,
            )

    # ============================================================ requests
    def submit(self, sub: Submission) -> Request:
        """Build and queue the request a caller submitted; InvalidRequestError
        if it can never run."""
        req = sub.to_request()
        self.add_request(req)
        return req

    def add_request(self, req: Request) -> None:
        """Queue a new request; raise InvalidRequestError if it can never run.
        A request that ``waits_for`` a live sibling is held until that
        sibling's prompt is planned (and so cached)."""
        table = self.table
        check_new_request(req, table.by_rid, self.config, adapters=self.adapters, pool=self.pool)
        if req.bootstrap is not None and self.disagg is not None:
            return self.disagg.announce(req)
        now = self._clock()
        req.times.arrival = req.times.queue_entry = now
        held = req.waits_for is not None and not leader_planned(req, table.by_rid)
        if not held:
            req.waits_for = None
        table.add(req, held=held)

    def abort(
        self, rid: str, message: str = "aborted by the client", *, code: str = "", emit: bool = True
    ) -> Request | None:
        """Finish a live request at once, freeing its pages; the request, or
        None if unknown. ``code``: the status the call ends with when the
        abort is the service's decision, not the client's (FinishAbort).
        ``emit=False``: the caller tells the client itself (no finish delta)."""
        req = self.table.get(rid)
        if req is None:
            return None
        self._finish(req, FinishAbort(message, code), emit=emit)
        return req

    def abort_adapter_requests(self, lora_id: str, message: str) -> int:
        """Abort every live request of adapter ``lora_id`` (it no longer
        loads: the calls end UNAVAILABLE with ``message``); how many."""
        reqs = [r for r in self.table if r.adapter == lora_id]
        for req in reqs:
            self._finish(req, FinishAbort(message, WORKER_LOST))
        return len(reqs)

    def drain(self) -> list[RequestDelta]:
        """Token deltas and finishes since the last call, in order."""
        out, self._outbox = self._outbox, []
        return out

    # ================================================= what others may read
    def in_flight(self) -> deque[StepPlan]:
        """The plans sent and not answered, oldest first (the engine, the
        worker codec and the tracer read them; nobody else changes them)."""
        return self._inflight

    def rids_in_plan(self, step_id: int) -> set[str]:
        """The requests a plan in flight computes (a step the worker failed)."""
        for plan in self._inflight:
            if plan.step_id == step_id:
                return {e.req.rid for e in plan.entries}
        return set()

    def is_idle(self) -> bool:
        busy = (self.disagg is not None and self.disagg.busy()) or (
            self.hicache is not None and self.hicache.reads_outstanding  # file reads out
        )
        return not (len(self.table) or self._inflight or self.table.leaves or busy)

    def live_rids(self) -> list[str]:
        return list(self.table.by_rid)

    def find(self, rid: str) -> Request | None:
        """The live request ``rid`` names, if any."""
        return self.table.get(rid)

    def table_sizes(self) -> tuple[int, int, int]:
        """(running incl. a chunked prefill, waiting incl. held siblings, live)."""
        t = self.table
        return len(t.running) + (t.chunked is not None), len(t.waiting) + len(t.held), len(t)

    # -------------------------------------------------------- LoRA adapters
    def loaded_adapters(self) -> list[Adapter]:
        """The registered adapters, in load order."""
        return list(self.adapters.loaded.values())

    def check_adapter(self, adapter: Adapter, *, loading: int = 0) -> None:
        """AdapterError if ``adapter`` could not be registered (``loading``:
        adapters being loaded that will count too)."""
        self.adapters.check_register(adapter, loading=loading)

    def register_adapter(self, adapter: Adapter) -> None:
        """Requests may name it from now on (every rank has loaded it)."""
        self.adapters.register(adapter)

    def unregister_adapter(self, lora_id: str) -> None:
        self.adapters.unregister(lora_id)

    def requests_of_adapter(self, lora_id: str) -> int:
        """Live requests (waiting or running) that use adapter ``lora_id``."""
        return sum(r.adapter == lora_id for r in self.table)

    def kv_snapshot(self) -> tuple[int, int, int]:
        """(pages in use by requests, evictable cached pages, pages in all)."""
        pool = self.pool
        return pool.num_used, self.cache.evictable_pages, pool.num_pages

    def load_figures(self) -> LoadFigures:
        host = self.hicache.host_pool if self.hicache is not None else None
        return load_figures(self.table, self.adapters, host)

    def take_kv_events(self) -> list:
        return self.cache.take_events()

    def note_stored_blocks(self, hashes: Iterable[int]) -> None:
        """The worker group's file tier already holds these blocks (its
        report when a session opens); ignored without a file tier."""
        if self.hicache is not None:
            self.hicache.note_stored_blocks(hashes)

    def flush_cache(self) -> tuple[bool, str]:
        """Drop every unlocked cached page, only while idle."""
        if len(self.table) or self._inflight:
            return False, "requests are in flight; flush when idle"
        freed = self.cache.evict_all_unlocked()
        return True, f"freed {freed} cached pages"

    # ================================================================ step
    def step(self) -> StepPlan | None:
        """Plan the next forward; None when there is nothing to send (or when
        plans in flight must be answered first: speculative decoding)."""
        table = self.table
        inflight = self._inflight
        if self.disagg is not None:  # timeouts; a decode unit's preallocation
            self.disagg.step_start(self.new_token_ratio)
        if inflight and inflight[-1].drafted:
            return None  # a drafted plan: its result decides what comes next
        self._drafting = False
        limit = self.config.speculative_disable_by_batch_size
        if (
            self._watch is not None
            and (not limit or len(table.running) <= limit)
            and self._watch.wants(table.running, self._step_id)
        ):
            if inflight:
                self.stats.spec_drains += 1
                return None  # drain: drafts need the last sampled tokens
            self._drafting = True
        if self.hicache is not None:  # before this plan inserts anything
            self.hicache.plan_writes()
        if table.held:
            self._release_held()
        mixed = self.config.enable_mixed_chunk and len(table.running) > 0
        decode_reqs = decode_candidates(table.running.values()) if mixed else []
        admitted = self._admit(len(decode_reqs))
        if not admitted:
            drafted, decodes = self._schedule_decode()
            if not decodes and not drafted:
                return self._idle_plan()
            mode = ForwardMode.DECODE
            if drafted:
                mode = ForwardMode.MIXED if decodes else ForwardMode.PREFILL
            plan = StepPlan(self._next_step_id(), mode, extends=drafted, decodes=decodes)
            self.stats.decode_steps += 1
        else:
            plan = StepPlan(self._next_step_id(), ForwardMode.PREFILL)
            self._plan_prefill(admitted, plan)
            # Decode the batch in the same forward if its pages fit after the
            # prefill's (requests preempted for the prefill are gone).
            decode_reqs = [r for r in decode_reqs if r.place is Place.RUNNING]
            if decode_reqs and pages_needed(decode_reqs, self.pool.page_size) <= (
                self.kv.available_pages()
            ):
                drafted, decodes = self._decode_rows(decode_reqs)
                plan.extends += drafted
                plan.decodes = decodes
                plan.mode = ForwardMode.MIXED
                self.stats.mixed_steps += 1
            else:
                self.stats.prefill_steps += 1
        plan.leaves = table.take_leaves()
        if self.adapters.changed:
            plan.adapter_slots = self.adapters.take_changes()
        if plan.drafted:
            self.stats.spec_steps += 1
            self.stats.spec_rows += sum(e.drafts is not None for e in plan.extends)
        if self.sliding is not None:  # once the whole plan is built (kv/manager.py)
            slide = self.kv.slide
            for e in plan.extends:
                slide(e.req)
            for e in plan.decodes:
                slide(e.req)
        self._send(plan)
        self.stats.steps += 1
        return plan

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _idle_plan(self) -> StepPlan | None:
        table = self.table
        if not table.running and not table.waiting and table.chunked is None:
            self.new_token_ratio = self.config.start_new_token_ratio
        self._abort_unschedulable()
        tier, dis = self.hicache, self.disagg
        if (
            not table.leaves
            and (tier is None or not tier.wants_plan(bool(self._inflight)))
            and (dis is None or not dis.landing_due())
        ):
            return None
        plan = StepPlan(self._next_step_id(), ForwardMode.IDLE, leaves=table.take_leaves())
        self._send(plan)
        return plan

    def _send(self, plan: StepPlan) -> None:
        """A built plan goes in flight, with what rides on every plan: the
        tiers' copies planned since the last one (their tokens counted: host
        hits loaded, tokens written) and the transfers that landed."""
        tier = self.hicache
        if tier is not None:
            tier.take_copies(plan)  # and the file tier's, if any
            page = self.config.page_size
            if plan.write_backs is not None:
                self.stats.hicache_written_tokens += len(plan.write_backs) * page
            if plan.loads is not None:
                self.stats.hicache_loaded_tokens += len(plan.loads) * page
        if self.disagg is not None:
            self.disagg.land(plan)
        self._inflight.append(plan)

    def _release_held(self) -> None:
        table = self.table
        for req in [r for r in table.held if leader_planned(r, table.by_rid)]:
            req.waits_for = None
            req.times.queue_entry = self._clock()
            table.release(req)

    # ------------------------------------------------------------- prefill
    def _admit(self, mixed_tokens: int) -> list[tuple[Request, int]]:
        """Ask admission what runs this step and apply its preemptions;
        returns the admitted requests with the end of what each computes."""
        cfg = self.config
        table = self.table
        self._admission_stuck = False
        if not table.waiting and table.chunked is None:
            return []
        reserved = self.disagg.reserved() if self.disagg is not None else []
        full = len(table.running) + len(reserved) >= cfg.max_running_requests
        full = full and table.chunked is None
        if full and not cfg.enable_priority_scheduling:
            return []
        running = list(table.running.values())
        if table.waiting:
            self.policy.order(table.waiting, running, self._clock())
        decision = plan_admission(
            cfg,
            self.kv,
            table.waiting,
            running,
            chunked=table.chunked,
            new_token_ratio=self.new_token_ratio,
            mixed_tokens=mixed_tokens,
            adapters=self.adapters,
            reserved=reserved,
        )
        self._admission_stuck = decision.stuck
        for req in decision.preempted:
            self._requeue(req, "preemption")
            req.preemptions += 1
            self.stats.preemptions += 1
        return decision.admitted

    def _plan_prefill(self, admitted: list[tuple[Request, int]], plan: StepPlan) -> None:
        part = prefill_part(admitted, self.kv, self._clock())
        plan.extends = part.extends
        plan.joins = part.joins
        self.stats.prompt_tokens += part.prompt_tokens
        self.stats.cached_tokens += part.cached_tokens
        self.table.admit(part.moves)
        for req, to in part.moves:
            if to is Place.RUNNING:
                self._start_decoding(req, pending=1)

    def _start_decoding(self, req: Request, pending: int = 0) -> None:
        start_decoding(
            req,
            drafter=self._drafter,
            watch=self._watch,
            max_draft=self.config.speculative_max_draft,
            pending=pending,
        )

    def _abort_unschedulable(self) -> None:
        """Abort the request first in line if it cannot fit even in an empty
        pool (admission/decision.unfit_head): only when nothing runs,
        nothing is in flight and admission was stuck."""
        table = self.table
        if table.running or self._inflight or not self._admission_stuck:
            return
        if self.disagg is not None and self.disagg.holders():
            return  # transfers hold pages they will give back
        unfit = unfit_head(table.chunked, table.waiting, self.pool)
        if unfit is not None:
            self._finish(*unfit)
            self.stats.oom_aborts += 1

    # -------------------------------------------------------------- decode
    def _decode_rows(self, reqs: list[Request]) -> tuple[list[PlanEntry], list[PlanEntry]]:
        return decode_rows(
            self.kv,
            reqs,
            drafter=self._drafter if self._drafting else None,
            step_id=self._step_id,
            context_len=self.config.context_len,
        )

    def _schedule_decode(self) -> tuple[list[PlanEntry], list[PlanEntry]]:
        """Decode the running batch, retracting requests when pages run out."""
        table = self.table
        if not table.running:
            return [], []
        candidates = decode_candidates(table.running.values())
        room = make_room(
            self.kv,
            candidates,
            chunked=table.chunked,
            results_pending=bool(self._inflight),
            priority_sign=self.config.retraction_priority_sign,
        )
        for req in room.retracted:
            self._retracted(req)
        if room.chunked_released:
            self._retracted(table.chunked, front=True)
        for req in room.out_of_memory:
            self.stats.oom_aborts += 1
            self._finish(req, oom_after_retraction(req))
        self.new_token_ratio = next_new_token_ratio(
            self.config, self.new_token_ratio, list(table.running.values()), len(room.retracted)
        )
        if not room.ready:
            return [], []
        if room.retracted:  # otherwise the batch, and so its candidates, did not change
            candidates = decode_candidates(table.running.values())
        return self._decode_rows(candidates) if candidates else ([], [])

    # ============================================================== update
    def update(self, result: StepResult) -> None:
        """Apply the worker's result for the oldest plan in flight."""
        inflight = self._inflight
        if not inflight or inflight[0].step_id != result.step_id:
            expected = inflight[0].step_id if inflight else None
            raise ProtocolError(f"result for step {result.step_id}, expected step {expected}")
        plan = inflight.popleft()
        if self.hicache is not None:  # its copies are done: give back what they held
            self.hicache.answered(plan.step_id, result.storage_done)
        got = apply_result(
            plan,
            result,
            now=self._clock(),
            eos_ids=self.config.eos_token_ids,
            stop_strings=self._stop_strings,
        )
        self._outbox += got.deltas
        stats = self.stats
        stats.generated_tokens += got.generated
        stats.discarded_tokens += got.discarded
        stats.spec_draft_tokens += got.draft_tokens
        stats.spec_accepted_tokens += got.accepted_tokens
        if plan.drafted:
            settle_drafts(plan, self.kv, self._step_id)
        dis = self.disagg
        for req, reason in got.finished:
            if dis is not None and dis.sends(req):  # a prefill unit's first token
                dis.first_token(req, reason, got.deltas)
                continue
            self._finish(req, reason, emit=False)  # its delta says it finished
        if self.table.scoring:  # max_new_tokens 0: done once its last chunk is back
            for e in plan.extends:
                req = e.req
                if (
                    req.place is Place.SCORING
                    and req.epoch == e.epoch
                    and e.start_pos + e.num_tokens == req.num_tokens
                ):
                    if req.embed is not None and req.rid not in got.embedded:
                        raise ProtocolError(f"step {plan.step_id}: no embedding for {req.rid}")
                    self._finish(req, FinishLength(req.sampling.max_new_tokens))

    # =============================================================== moves
    def _requeue(self, req: Request, why: str, *, front: bool = False) -> None:
        """A request whose KV was released waits again."""
        self.table.requeue(req, self._clock(), front=front)
        if self.on_requeue is not None:
            self.on_requeue(req, why)

    def _retracted(self, req: Request, *, front: bool = False) -> None:
        self._requeue(req, "retraction", front=front)
        req.retractions += 1
        self.stats.retractions += 1

    def _finish(self, req: Request, reason: FinishReason, *, emit: bool = True) -> None:
        """Finish ``req`` wherever it is, cache its tokens and free its pages
        (unless a transfer still holds them: core/disagg/)."""
        was = self.table.remove(req)
        if self.disagg is None or not self.disagg.on_finish(req, was):
            self.kv.release(req)
        if req.spec is not None:  # its n-gram index and cache cursor
            req.spec.lookup = req.spec.radix_cont = None
        req.finish(reason, self._clock())
        kinds = self.stats.finished
        kinds[reason.kind] = kinds.get(reason.kind, 0) + 1
        if emit:
            self._outbox.append(RequestDelta(req, [], finished=True))

    # ========================================================= worker loss
    def reset_after_worker_loss(self, num_pages: int | None = None) -> list[Request]:
        """The worker group was lost with its KV pages, but every request's
        tokens are here: drop the radix cache, the page pool's state and the
        plans in flight, and send every request the worker held back to wait
        with the output it has, exactly like a retracted one. Tokens that
        were in flight are sampled again on the same context, and nothing is
        delivered twice (deliveries only come from ``update()``).

        ``num_pages``: the pool size of the worker group that came back (None:
        unchanged). Safe to call again while nothing ran in between. Returns
        the requests sent back to wait.
        """
        lost = self.table.requeue_after_loss(self._clock())
        forget_worker_state(lost)
        if self.disagg is not None:  # transfers in flight end; landed KV is re-prefilled
            self.disagg.worker_lost()
        self.stats.cached_tokens -= forget_cache_reads(self.table)
        self._inflight.clear()
        self.adapters.reset()  # the new worker has no adapter in its slots
        self._admission_stuck = False
        # Both tiers (the host pool is the worker's too) and every copy in
        # flight; emits AllBlocksCleared for the cache-aware router.
        self.cache.reset()
        self.pool.reset(num_pages)
        if self.sliding is not None:
            self.sliding.reset()
        self.stats.worker_losses += 1
        self.stats.worker_loss_requeues += len(lost)
        if self.on_requeue is not None:
            for req in lost:
                self.on_requeue(req, "worker loss")
        logger.info(
            "worker state dropped",
            requeued=len(lost),
            waiting=len(self.table.waiting),
            num_pages=self.pool.num_pages,
        )
        return lost

    def resize_pool(self, num_pages: int, num_swa_pages: int = 0, num_host_pages: int = 0) -> None:
        """Take the page counts of the worker group that came back; only while
        nothing holds KV (between reset_after_worker_loss and the next step).
        ``num_swa_pages``: its sliding pool (0: none), which it must have
        exactly when this scheduler has one; ``num_host_pages``: its host
        pool, which it must have when this scheduler has a host tier (one this
        scheduler does not use is harmless: it is sent no copies)."""
        if self._inflight:
            raise RuntimeError("the page pool can only be resized while it is empty")
        host = self.hicache.host_pool if self.hicache is not None else None
        resize_pools(self.kv, num_pages, num_swa_pages, host=host, num_host_pages=num_host_pages)

    # ========================================================== invariants
    def check_integrity(self) -> None:
        """Every page is exactly one of free, cached-unlocked, or held (by a
        request's own pages or a locked cache node); every live request is in
        the place its field names, in a state that fits it."""
        dis = self.disagg
        held = dis.holders() if dis is not None else ()
        check_scheduler_integrity(self.kv, self.table, self._inflight, held)
        if dis is not None:
            dis.check_integrity()
        self.adapters.check_integrity((r.rid, r.adapter, r.adapter_slot) for r in self.table)


__all__ = ["ENGINE_INTERFACE", "ProtocolError", "Scheduler"]
