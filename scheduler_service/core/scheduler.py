"""The scheduler's loop body: ``step() -> StepPlan`` and ``update(StepResult)``.

Each step is a prefill (admit waiting requests, continue a chunked one),
optionally mixed with the decode batch, or else a decode of the running
batch (retracting requests when pages run out), as in SGLang.

Overlap: ``step()`` for N+1 may run before ``update()`` for N. Decode entries
then name "the last sampled token", in-flight tokens are counted in
``Request.pending``, and results are matched to the request *epoch* they were
planned for: a request retracted, preempted or finished since has its late
token discarded (a finished one's extra step only wrote a page that is freed).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.finish import StopStringChecker, check_finish
from scheduler_service.core.kv_ownership import KvManager
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.page_pool import PagePool
from scheduler_service.core.plan import (
    ForwardMode,
    JoinRequest,
    RequestOutput,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from scheduler_service.core.policy import SchedulePolicy, request_tokens
from scheduler_service.core.prefill_adder import AddResult, PrefillAdder
from scheduler_service.core.radix_cache import RadixCache
from scheduler_service.core.request import (
    FinishAbort,
    FinishLength,
    FinishReason,
    Request,
    RequestState,
)
from scheduler_service.core.sampling import InvalidRequestError

logger = structlog.get_logger(__name__)


class ProtocolError(RuntimeError):
    """A step result that does not fit the plan it answers."""


@dataclass(slots=True)
class _InFlight:
    step_id: int
    # rid -> (request, its epoch when planned, whether the entry samples)
    entries: dict[str, tuple[Request, int, bool]]
    expected_tokens: int
    # Requests whose prefill completes in this step without sampling
    # (max_new_tokens == 0): they finish when the step's result arrives.
    prefill_only: list[tuple[Request, int]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_pages: int,
        stop_strings: StopStringChecker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.cache = RadixCache(config.page_size, self.pool, enable_events=config.enable_kv_events)
        self.kv = KvManager(self.pool, self.cache)
        self.policy = SchedulePolicy(config, self.cache)
        self.running = RunningBatch(self.kv)
        self.waiting: list[Request] = []
        self.chunked: Request | None = None
        self.requests: dict[str, Request] = {}
        self.new_token_ratio = config.start_new_token_ratio
        self.stats = SchedulerStats()
        self._stop_strings = stop_strings
        self._clock = clock
        self._step_id = 0
        self._inflight: deque[_InFlight] = deque()
        self._leaves: list[str] = []
        self._outbox: list[RequestDelta] = []
        self._admission_stuck = False

    # ============================================================ requests
    def add_request(self, req: Request) -> None:
        """Queue a request; raise InvalidRequestError if it can never run."""
        if req.rid in self.requests:
            raise InvalidRequestError(f"request id {req.rid!r} is already in use")
        if req.state is not RequestState.WAITING or req.output_ids or req.pages:
            raise InvalidRequestError(f"request {req.rid!r} is not a fresh request")
        req.validate(self.config.vocab_size, self.config.context_len)
        capacity = self.pool.num_pages * self.pool.page_size
        if len(req.prompt_ids) + 1 > capacity:
            raise InvalidRequestError(
                f"request {req.rid}: the prompt has {len(req.prompt_ids)} tokens but the KV "
                f"cache holds {capacity} tokens in all"
            )
        now = self._clock()
        req.times.arrival = req.times.queue_entry = now
        self.waiting.append(req)
        self.requests[req.rid] = req

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        """Finish a live request at once, freeing its pages; False if unknown."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._finish(req, FinishAbort(message))
        return True

    def drain(self) -> list[RequestDelta]:
        """Token deltas and finishes since the last call, in order."""
        out, self._outbox = self._outbox, []
        return out

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_idle(self) -> bool:
        return not (self.requests or self._inflight or self._leaves)

    # ================================================================ step
    def step(self) -> StepPlan | None:
        """Plan the next forward; None when there is nothing to send."""
        mixed = self.config.enable_mixed_chunk and len(self.running) > 0
        decode_reqs = self.running.decode_candidates() if mixed else []
        prefill = self._schedule_prefill(len(decode_reqs))
        if not prefill:
            decode_entries = self._schedule_decode()
            if not decode_entries:
                return self._idle_plan()
            plan = StepPlan(self._next_step_id(), ForwardMode.DECODE, leaves=self._take_leaves())
            record = _InFlight(plan.step_id, {}, 0)
            self.stats.decode_steps += 1
        else:
            plan = StepPlan(self._next_step_id(), ForwardMode.PREFILL, leaves=self._take_leaves())
            record = _InFlight(plan.step_id, {}, 0)
            self._plan_prefill(prefill, plan, record)
            # Decode the batch in the same forward if its pages fit after the
            # prefill's (requests preempted for the prefill are gone).
            decode_reqs = [r for r in decode_reqs if r.state is RequestState.DECODING]
            decode_entries = []
            if decode_reqs and self.running.pages_needed(decode_reqs) <= self.kv.available_pages():
                decode_entries = self.running.prepare_decode(decode_reqs)
                plan.mode = ForwardMode.MIXED
                self.stats.mixed_steps += 1
            else:
                self.stats.prefill_steps += 1
        plan.entries.extend(decode_entries)
        entries = record.entries
        requests = self.requests
        for e in decode_entries:
            req = requests[e.rid]
            entries[e.rid] = (req, req.epoch, True)
        record.expected_tokens += len(decode_entries)
        self._inflight.append(record)
        self.stats.steps += 1
        return plan

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _take_leaves(self) -> list[str]:
        leaves, self._leaves = self._leaves, []
        return leaves

    def _idle_plan(self) -> StepPlan | None:
        if not self.running and not self.waiting and self.chunked is None:
            self.new_token_ratio = self.config.start_new_token_ratio
        self._abort_unschedulable()
        if not self._leaves:
            return None
        plan = StepPlan(self._next_step_id(), ForwardMode.IDLE, leaves=self._take_leaves())
        self._inflight.append(_InFlight(plan.step_id, {}, 0))
        return plan

    def _abort_unschedulable(self) -> None:
        """Nothing runs and nothing is in flight, yet nothing was admitted: an
        idle scheduler admits any request that fits, so the one first in line
        cannot fit even in an empty pool (a retracted request that grew), and
        waiting longer cannot help."""
        if self.running or self._inflight or not self._admission_stuck:
            return
        head = self.chunked if self.chunked is not None else (self.waiting or [None])[0]
        if head is None:
            return
        capacity = self.pool.num_pages * self.pool.page_size
        logger.warning("request does not fit the KV pool", rid=head.rid, tokens=head.num_tokens)
        self._finish(
            head,
            FinishAbort(
                f"out of memory: the request needs {head.num_tokens + 1} tokens of KV cache "
                f"and the pool holds {capacity}"
            ),
        )
        self.stats.oom_aborts += 1

    # ------------------------------------------------------------ prefill
    def _schedule_prefill(self, mixed_tokens: int) -> list[tuple[Request, int]]:
        cfg = self.config
        self._admission_stuck = False
        if not self.waiting and self.chunked is None:
            return []
        priority = cfg.enable_priority_scheduling
        if len(self.running) >= cfg.max_running_requests and self.chunked is None and not priority:
            return []
        if self.waiting:
            self.policy.order(self.waiting, self.running)
        adder = PrefillAdder(cfg, self.kv, self.running.reqs(), self.new_token_ratio, mixed_tokens)
        if self.chunked is not None:
            result = adder.add_chunked_req(self.chunked)
            if not adder.admitted:
                return []  # first in line and stuck: nobody overtakes it
        else:
            result = AddResult.CONTINUE
        if result is AddResult.CONTINUE:
            for req in self.waiting:
                full = len(adder.admitted) >= cfg.max_running_requests - len(self.running)
                if full and not (
                    priority and adder.preempt_to_schedule(req, self.running.reqs(), self._preempt)
                ):
                    break
                self._match(req)
                result = adder.add_one_req(req)
                admitted = bool(adder.admitted) and adder.admitted[-1][0] is req
                if (
                    not admitted
                    and result is AddResult.NO_TOKEN
                    and priority
                    and adder.preempt_to_schedule(req, self.running.reqs(), self._preempt)
                ):
                    self._match(req)
                    result = adder.add_one_req(req)
                if result is not AddResult.CONTINUE:
                    break
        admitted = adder.admitted
        # An idle scheduler admits whatever fits; if it admitted nothing, the
        # request first in line can never fit (see _abort_unschedulable).
        self._admission_stuck = adder.nothing_running and not admitted
        if admitted:
            taken = {id(r) for r, _ in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        self.waiting.extend(adder.preempted)
        self.chunked = adder.new_chunked
        self.stats.cached_tokens += adder.hit_tokens
        return admitted

    def _match(self, req: Request) -> None:
        m = self.cache.match(request_tokens(req), req.extra_key, limit=req.max_prefix_len())
        req.match_pages, req.match_len, req.match_node = m.pages, m.length, m.node

    def _plan_prefill(
        self, admitted: list[tuple[Request, int]], plan: StepPlan, record: _InFlight
    ) -> None:
        now = self._clock()
        kv = self.kv
        for req, end in admitted:
            start = req.kv_len
            # A joining request's table starts empty on the worker: send it all,
            # the cached prefix's pages included.
            known = len(req.pages) if req.on_worker else 0
            if kv.grow(req, end) is None:
                raise RuntimeError(f"prefill of {req.rid} lacks pages the adder counted")
            new_pages = req.pages[known:]
            tokens = request_tokens(req)
            if req.state is not RequestState.PREFILLING:
                req.move_to(RequestState.PREFILLING)
                req.cached_tokens += start
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = now
                    self.stats.prompt_tokens += len(req.prompt_ids)
            if not req.on_worker:
                plan.joins.append(self._join(req, tokens, start))
                req.on_worker = True
            final = end == req.num_tokens
            sample = final and len(req.output_ids) < req.sampling.max_new_tokens
            entry = ScheduledRequest(req.rid, start, tokens[start:end], new_pages, sample)
            if req.prompt_logprobs_pending and end < len(req.prompt_ids):
                entry.next_token = tokens[end]
            plan.entries.append(entry)
            record.entries[req.rid] = (req, req.epoch, sample)
            req.kv_len = end
            if sample:
                record.expected_tokens += 1
                req.move_to(RequestState.DECODING)
                req.pending = 1
                self.running.merge([req])
            elif final:
                record.prefill_only.append((req, req.epoch))
        for req, _ in admitted:
            kv.cache_computed_prefix(req)

    @staticmethod
    def _join(req: Request, tokens: list[int], start: int) -> JoinRequest:
        logprobs = req.logprobs
        if logprobs.wants_prompt_logprobs and not req.prompt_logprobs_pending:
            logprobs = dataclasses.replace(logprobs, logprob_start_len=-1)
        return JoinRequest(
            rid=req.rid,
            sampling=req.sampling,
            logprobs=logprobs,
            prompt_len=len(req.prompt_ids),
            prefix_ids=tokens[:start],
            num_output_tokens=len(req.output_ids),
        )

    # ------------------------------------------------------------- decode
    def _schedule_decode(self) -> list[ScheduledRequest]:
        if not self.running:
            return []
        cfg = self.config
        retracted, ready = self.running.make_room_for_decode(
            self._retract, self._retract_chunked, self._abort_oom, bool(self._inflight)
        )
        if retracted:
            reqs = self.running.reqs()
            decoded = sum(len(r.output_ids) for r in reqs)
            budget = sum(r.sampling.max_new_tokens for r in reqs)
            estimate = min(1.0, (decoded + cfg.retract_decode_steps * len(reqs)) / max(budget, 1))
            self.new_token_ratio = max(self.new_token_ratio, estimate)
            logger.info(
                "retracted requests to fit decode",
                retracted=retracted,
                running=len(reqs),
                new_token_ratio=round(self.new_token_ratio, 3),
            )
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio
            )
        if not ready:
            return []
        candidates = self.running.decode_candidates()
        return self.running.prepare_decode(candidates) if candidates else []

    def _requeue(self, req: Request) -> None:
        """Release a running or chunked request's KV and send it back to wait."""
        self.kv.release(req, cache_tokens=True)
        self._leave(req)
        req.move_to(RequestState.RETRACTED)
        req.epoch += 1
        req.pending = 0
        req.times.queue_entry = self._clock()

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self._requeue(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.append(req)

    def _preempt(self, req: Request) -> None:
        """Called by the adder; the adder queues the request after admission."""
        self.running.remove(req)
        self._requeue(req)
        req.preemptions += 1
        self.stats.preemptions += 1

    def _retract_chunked(self) -> bool:
        req = self.chunked
        if req is None:
            return False
        self.chunked = None
        self._requeue(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, req)
        return True

    def _abort_oom(self, req: Request) -> None:
        logger.warning("out of memory even after retraction", rid=req.rid, tokens=req.num_tokens)
        self.stats.oom_aborts += 1
        self._finish(
            req,
            FinishAbort(
                "out of memory: the KV cache cannot hold this request even after retracting "
                "all others"
            ),
        )

    # ============================================================== update
    def update(self, result: StepResult) -> None:
        """Apply the worker's result for the oldest plan in flight."""
        if not self._inflight or self._inflight[0].step_id != result.step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ProtocolError(f"result for step {result.step_id}, expected step {expected}")
        record = self._inflight.popleft()
        tokens = sum(1 for out in result.outputs if out.token_id is not None)
        if tokens != record.expected_tokens:
            raise ProtocolError(
                f"step {record.step_id}: {tokens} sampled tokens for "
                f"{record.expected_tokens} sampling entries"
            )
        now = self._clock()
        for out in result.outputs:
            item = record.entries.get(out.rid)
            if item is None:
                raise ProtocolError(f"step {record.step_id} has no entry for {out.rid!r}")
            req, epoch, samples = item
            if samples != (out.token_id is not None):
                raise ProtocolError(f"step {record.step_id}: {out.rid} sampled {samples=}")
            if req.epoch != epoch:
                if samples:
                    self.stats.discarded_tokens += 1
                continue
            self._apply_output(req, out, now)
        for req, epoch in record.prefill_only:
            if req.epoch == epoch:
                self._finish(req, FinishLength(req.sampling.max_new_tokens))

    def _apply_output(self, req: Request, out: RequestOutput, now: float) -> None:
        token = out.token_id
        if token is None:  # a prefill chunk: only prompt logprobs can come back
            delta = RequestDelta(req, [], [])
            self._take_prompt_logprobs(req, out, delta)
            if delta.prompt_logprobs:
                self._outbox.append(delta)
            return
        delta = RequestDelta(req, [token], [out.logprobs])
        if out.prompt_logprobs:
            self._take_prompt_logprobs(req, out, delta)
        req.pending -= 1
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now
        self._outbox.append(delta)
        reason = check_finish(req, token, self.config.eos_token_ids, self._stop_strings)
        if reason is not None:
            delta.finished = True
            self._finish(req, reason, emit=False)

    @staticmethod
    def _take_prompt_logprobs(req: Request, out: RequestOutput, delta: RequestDelta) -> None:
        """Deliver each prompt position once, even if a retracted request's
        re-prefill computes it again."""
        logprobs = out.prompt_logprobs or []
        start = out.prompt_logprobs_start
        skip = max(0, req.prompt_logprobs_sent - start)
        logprobs = logprobs[skip:]
        start += skip
        if not logprobs:
            return
        req.prompt_logprobs_sent = start + len(logprobs)
        if req.prompt_logprobs_sent >= len(req.prompt_ids):
            req.prompt_logprobs_pending = False
        delta.prompt_logprobs = logprobs
        delta.prompt_logprobs_start = start

    # ============================================================= finish
    def _leave(self, req: Request) -> None:
        if req.on_worker:
            self._leaves.append(req.rid)
            req.on_worker = False

    def _finish(self, req: Request, reason: FinishReason, emit: bool = True) -> None:
        """Finish ``req`` wherever it is, cache its tokens and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req.state in (RequestState.WAITING, RequestState.RETRACTED):
            self.waiting.remove(req)
        self.kv.release(req, cache_tokens=True)
        self._leave(req)
        req.finish(reason, self._clock())
        del self.requests[req.rid]
        kinds = self.stats.finished
        kinds[reason.kind] = kinds.get(reason.kind, 0) + 1
        if emit:
            self._outbox.append(RequestDelta(req, [], finished=True))

    # ========================================================== invariants
    def check_integrity(self) -> None:
        """Every page is exactly one of free, cached-unlocked, or held (by a
        request's own pages or a locked cache node); every live request is in
        exactly one place, in a state that fits it."""
        holders: dict[int, int] = {}
        self.cache.check_integrity(holders)
        placed: dict[str, str] = {}

        def place(req: Request, where: str) -> None:
            if req.rid in placed:
                raise AssertionError(f"{req.rid} is both {placed[req.rid]} and {where}")
            if self.requests.get(req.rid) is not req:
                raise AssertionError(f"{req.rid} ({where}) is not a live request")
            placed[req.rid] = where

        locking = 0
        for req in self.waiting:
            place(req, "waiting")
            if req.state not in (RequestState.WAITING, RequestState.RETRACTED):
                raise AssertionError(f"waiting request {req.rid} is {req.state}")
            if req.pages or req.last_node is not None or req.pending:
                raise AssertionError(f"waiting request {req.rid} holds KV or tokens in flight")
        holding = [(r, "running") for r in self.running]
        if self.chunked is not None:
            holding.append((self.chunked, "chunked"))
        for rec in self._inflight:
            holding.extend((r, "prefill-only") for r, e in rec.prefill_only if r.epoch == e)
        for req, where in holding:
            place(req, where)
            expected = {
                "running": RequestState.DECODING,
                "chunked": RequestState.PREFILLING,
                "prefill-only": RequestState.PREFILLING,
            }[where]
            if req.state is not expected:
                raise AssertionError(f"{where} request {req.rid} is {req.state}")
            if where == "running" and req.kv_len != req.num_tokens + req.pending - 1:
                raise AssertionError(
                    f"{req.rid}: kv_len {req.kv_len} != tokens {req.num_tokens} + pending "
                    f"{req.pending} - 1"
                )
            self.kv.add_request_holdings(req, holders)
            if req.last_node is not None and req.last_node.parent is not None:
                locking += 1
        missing = set(self.requests) - set(placed)
        if missing:
            raise AssertionError(f"live requests nowhere to be found: {sorted(missing)[:5]}")
        locks = sum(c.lock_ref for root in self.cache.roots() for c in root.children.values())
        if locks != locking:
            raise AssertionError(f"cache holds {locks} request locks, requests hold {locking}")
        self.pool.check_integrity(holders)


__all__ = ["ProtocolError", "Scheduler"]
