"""A step's prefill entries, from what admission decided.

For each admitted request (and the end of the positions it computes this
step) it allocates the pages, builds the plan entry, and a join for a request
the worker does not hold yet (with the cached prefix it will not see as
inputs). It advances each request's own state (PREFILLING, ``kv_len``) but
moves none between the scheduler's queues: it returns the requests whose
final chunk samples, which the scheduler moves into the running batch.
"""

from __future__ import annotations

import dataclasses

from scheduler_service.core.admission.policy import request_tokens
from scheduler_service.core.inflight import InFlight
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.outputs import SchedulerStats
from scheduler_service.core.plan import JoinRequest, ScheduledRequest, StepPlan
from scheduler_service.core.request import Request, RequestState


def plan_prefill(
    admitted: list[tuple[Request, int]],
    plan: StepPlan,
    record: InFlight,
    kv: KvManager,
    now: float,
    stats: SchedulerStats,
) -> list[Request]:
    """Add the admitted requests' entries (and joins) to ``plan`` and
    ``record``; return the requests that sample this step (prefill done)."""
    sampling: list[Request] = []
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
            if not req.cache_hits_counted:
                req.cache_hits_counted = True
                hit = min(start, len(req.prompt_ids))
                req.cached_tokens = hit
                stats.cached_tokens += hit
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
                stats.prompt_tokens += len(req.prompt_ids)
        if not req.on_worker:
            plan.joins.append(join_request(req, tokens, start))
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
            sampling.append(req)
        elif final:
            record.prefill_only.append((req, req.epoch))
    for req, _ in admitted:
        kv.cache_computed_prefix(req)
    return sampling


def join_request(req: Request, tokens: list[int], start: int) -> JoinRequest:
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
        trace_context=req.trace_context,
        adapter_slot=req.adapter_slot,
    )
