"""Prefill steps: order the queue, admit under the budgets, plan the chunks."""

from __future__ import annotations

import dataclasses

import structlog

from scheduler_service.core.plan import JoinRequest, ScheduledRequest, StepPlan
from scheduler_service.core.policy import request_tokens
from scheduler_service.core.prefill_adder import AddResult, PrefillAdder
from scheduler_service.core.radix_cache import RadixCache
from scheduler_service.core.request import FinishAbort, Request, RequestState
from scheduler_service.core.scheduler_base import InFlight, SchedulerBase

logger = structlog.get_logger(__name__)


class _InBatchPrefixes:
    """The prompts admitted in this step, so that a request sharing a long
    uncached prefix with one of them can wait a step and then find it cached
    (``SchedulerConfig.prefix_hold_tokens``)."""

    def __init__(self, hold_tokens: int, admitted: list[tuple[Request, int]]) -> None:
        self.hold = hold_tokens
        self.tree: RadixCache | None = None
        for req, _ in admitted:
            self.add(req)

    def add(self, req: Request) -> None:
        if not self.hold:
            return
        if self.tree is None:
            self.tree = RadixCache(page_size=1)
        tokens = request_tokens(req)
        self.tree.insert(tokens, [0] * len(tokens), req.extra_key)

    def should_wait(self, req: Request) -> bool:
        if self.tree is None:  # nothing admitted yet (or holding is off)
            return False
        shared = self.tree.match(request_tokens(req), req.extra_key, touch=False).length
        return shared - req.match_len >= self.hold


class AdmissionMixin(SchedulerBase):
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
                # First in line and out of memory: nobody overtakes it.
                self._admission_stuck = adder.nothing_running
                return []
        else:
            result = AddResult.CONTINUE
        if result is AddResult.CONTINUE:
            held = _InBatchPrefixes(cfg.prefix_hold_tokens, adder.admitted)
            for req in self.waiting:
                full = len(adder.admitted) >= cfg.max_running_requests - len(self.running)
                if full and not (
                    priority and adder.preempt_to_schedule(req, self.running.reqs(), self._preempt)
                ):
                    break
                self._match(req)
                if held.should_wait(req):
                    continue
                result = adder.add_one_req(req)
                taken = bool(adder.admitted) and adder.admitted[-1][0] is req
                if taken:
                    held.add(req)
                if (
                    not taken
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
        self, admitted: list[tuple[Request, int]], plan: StepPlan, record: InFlight
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
        logger.warning(
            "request does not fit the KV pool",
            request_id=head.rid,
            trace_id=head.trace_id,
            tokens=head.num_tokens,
        )
        self._finish(
            head,
            FinishAbort(
                f"out of memory: the request needs {head.num_tokens + 1} tokens of KV cache "
                f"and the pool holds {capacity}"
            ),
        )
        self.stats.oom_aborts += 1
