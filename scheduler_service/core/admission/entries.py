"""A step's prefill entries, from what admission decided.

For each admitted request (and the end of the positions it computes this
step) it allocates the pages, builds the extend entry, and a join for a
request the worker does not hold yet (with the cached prefix it will not see
as inputs). It advances each request's own KV state (``kv_len``, pages, the
prefix it shares through the cache) and returns the rest as a
``PrefillPart``: the entries and joins for the plan, where each request goes
(chunked, running, scoring), and the token counts for the statistics; the
scheduler applies it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from scheduler_service.core.admission.policy import request_tokens
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.plan import Join, PlanEntry
from scheduler_service.core.request import Place, Request


@dataclass(slots=True)
class PrefillPart:
    """A step's prefill, for the scheduler to apply."""

    extends: list[PlanEntry] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    # Where each admitted request goes, in plan order: CHUNKED (its prefill
    # continues), RUNNING (its last chunk samples) or SCORING (its last chunk
    # samples nothing: max_new_tokens 0; it finishes with the result).
    moves: list[tuple[Request, Place]] = field(default_factory=list)
    prompt_tokens: int = 0  # of requests scheduled for the first time
    cached_tokens: int = 0  # prompt tokens read from the cache at a first admission


def prefill_part(admitted: list[tuple[Request, int]], kv: KvManager, now: float) -> PrefillPart:
    """The entries, joins and moves of the admitted requests (request, end of
    the positions it computes this step)."""
    part = PrefillPart()
    for req, end in admitted:
        start = req.kv_len
        joining = not req.on_worker
        # A joining request's table starts empty on the worker: send it all,
        # the cached prefix's pages included.
        known = 0 if joining else len(req.pages)
        if kv.grow(req, end) is None:
            raise RuntimeError(f"prefill of {req.rid} lacks pages the adder counted")
        new_pages = req.pages[known:]
        new_swa = kv.new_swa(req, known)
        tokens = request_tokens(req)
        if req.place is Place.WAITING and not req.cache_hits_counted:
            req.cache_hits_counted = True
            req.cached_tokens = hit = min(start, len(req.prompt_ids))
            part.cached_tokens += hit
        if req.times.first_scheduled is None:
            req.times.first_scheduled = now
            part.prompt_tokens += len(req.prompt_ids)
        if joining:
            part.joins.append(join_of(req, tokens, start))
        final = end == req.num_tokens
        scores = req.sampling.max_new_tokens == 0
        # Scoring samples only for the next-token row (results.py keeps no token).
        sample = final and (
            len(req.output_ids) < req.sampling.max_new_tokens
            or (scores and req.logprobs.wants_next_token_row)
        )
        entry = PlanEntry(
            req,
            req.epoch,
            start,
            tokens[start:end],
            new_pages=new_pages,
            sample=sample,
            new_swa_pages=new_swa,
        )
        if req.prompt_logprobs_pending and end < len(req.prompt_ids):
            entry.next_token = tokens[end]
        part.extends.append(entry)
        req.kv_len = end
        if final and (scores or not sample):
            part.moves.append((req, Place.SCORING))
        elif sample:
            part.moves.append((req, Place.RUNNING))
        else:
            part.moves.append((req, Place.CHUNKED))
    for req, _ in admitted:
        kv.cache_computed_prefix(req)
    return part


def join_of(req: Request, tokens: list[int], start: int) -> Join:
    logprobs = req.logprobs
    if logprobs.wants_prompt_logprobs and not req.prompt_logprobs_pending:
        logprobs = dataclasses.replace(logprobs, logprob_start_len=-1)
    return Join(
        rid=req.rid,
        sampling=req.sampling,
        logprobs=logprobs,
        prompt_len=len(req.prompt_ids),
        prefix_ids=tokens[:start],
        num_output_tokens=len(req.output_ids),
        trace_context=req.trace_context,
        adapter_slot=req.adapter_slot,
        embed=req.embed,
    )
