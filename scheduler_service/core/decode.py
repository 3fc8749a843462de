"""Decode scheduling, the decisions the Scheduler asks for: which running
requests decode, which give up their KV when pages run out (retraction, in
SGLang's length or priority order), which cannot fit at all, the decode
rows of a step (plain, or drafted when the step drafts) and the new-token
ratio.

Decode under overlap: when plan N+1 is built, the token of step N may not be
known yet. Each decode entry therefore says "compute your last sampled token
at position kv_len", and ``pending`` counts the tokens in flight, so::

    kv_len == len(prompt) + len(output) + pending - 1   (while decoding)

A request whose known plus in-flight outputs reach max_new_tokens is not
scheduled again: it only waits for its last result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.plan import PlanEntry, decode_entry
from scheduler_service.core.request import OUT_OF_CAPACITY, FinishAbort, Request
from scheduler_service.core.spec.drafts import Drafter
from scheduler_service.core.spec.rows import DraftWatch, plan_drafted_rows
from scheduler_service.core.spec.state import SpecState

logger = structlog.get_logger(__name__)


@dataclass(slots=True)
class DecodeRoom:
    """What making room for a decode step decided (see make_room)."""

    # Running requests whose KV was released, least progress last: back to wait.
    retracted: list[Request] = field(default_factory=list)
    # The chunked prefill's KV was released too: it goes back, first in line.
    chunked_released: bool = False
    # Requests that cannot fit even alone, with no result in flight: abort.
    out_of_memory: list[Request] = field(default_factory=list)
    # Whether the decode can run now.
    ready: bool = False


def decode_candidates(running: Iterable[Request]) -> list[Request]:
    """Running requests that still sample (the others only await their last token)."""
    return [r for r in running if len(r.output_ids) + r.pending < r.sampling.max_new_tokens]


def pages_needed(reqs: list[Request], page_size: int) -> int:
    """Fresh pages one decode of each of ``reqs`` takes."""
    return sum(1 for r in reqs if r.kv_len % page_size == 0)


def retraction_order(reqs: list[Request], priority_sign: int = 0) -> list[Request]:
    """The requests to keep most first; retraction pops from the end. SGLang's
    orders: "length" (``priority_sign`` 0) keeps the most progress, so the
    fewest outputs, then the longest prompt, go first; "priority" (the
    config's ``retraction_priority_sign``) takes the lowest priority first
    and orders equal priorities by length."""
    return sorted(
        reqs,
        key=lambda r: (-r.priority * priority_sign, len(r.output_ids), -len(r.prompt_ids)),
        reverse=True,
    )


def make_room(
    kv: KvManager,
    candidates: list[Request],
    *,
    chunked: Request | None,
    results_pending: bool,
    priority_sign: int = 0,
) -> DecodeRoom:
    """Decide which requests give up their KV so the next decode fits.

    Retracts in ``retraction_order`` (``priority_sign``: see there),
    keeping at least one request; if even that one cannot fit, the chunked
    prefill in progress gives up its KV too, then any request left that
    holds duplicates of cached pages
    (kv/manager.py). If it still cannot fit and results are in flight (which
    may finish requests and free pages), decoding waits for them; otherwise
    the requests left are out of memory. Requests only waiting for their
    last token (not among ``candidates``) are left alone.

    The KV of every request named in the answer is released here (each
    release changes what the next one must free); moving the requests is
    the scheduler's.
    """
    page_size = kv.page_size
    room = DecodeRoom()
    available = kv.available_pages()
    # Each decode takes at most one page: with that many available, no need
    # to count (the common case, a pass over the batch saved).
    if len(candidates) <= available:
        room.ready = True
        return room
    needed = pages_needed(candidates, page_size)
    if needed <= available:
        room.ready = True
        return room
    order = retraction_order(candidates, priority_sign)
    while len(order) > 1 and needed > kv.available_pages():
        victim = order.pop()
        needed -= victim.kv_len % page_size == 0
        kv.release(victim)
        room.retracted.append(victim)
    if needed > kv.available_pages() and chunked is not None:
        kv.release(chunked)
        room.chunked_released = True
    if needed > kv.available_pages():
        # A request holding duplicates of cached pages pins both copies (its
        # later pages hang under the cache's); retracted, it reads the cache's
        # copy back and needs no more than it would have alone. Not while its
        # prompt logprobs are still to come: it would compute the same
        # duplicates again (results in flight deliver them, and decoding
        # waits for those).
        for victim in [r for r in order if r.dup_pages and not r.prompt_logprobs_pending]:
            order.remove(victim)
            needed -= victim.kv_len % page_size == 0
            kv.release(victim)
            room.retracted.append(victim)
    if needed <= kv.available_pages():
        room.ready = True
    elif not results_pending:
        room.out_of_memory = order
    return room


def oom_after_retraction(req: Request) -> FinishAbort:
    """Why ``req`` is aborted: it cannot fit even alone."""
    logger.warning(
        "out of memory even after retraction",
        request_id=req.rid,
        trace_id=req.trace_id,
        tokens=req.num_tokens,
    )
    return FinishAbort(
        "out of memory: the KV cache cannot hold this request even after retracting all others",
        OUT_OF_CAPACITY,
    )


def plain_decodes(kv: KvManager, reqs: list[Request]) -> list[PlanEntry]:
    """One decode entry per request; the caller made sure the pages fit.
    The pages are taken after the entries are built, for the few entries
    that start a page (one pass over the batch, not two)."""
    page_size = kv.page_size
    entries = [decode_entry(r, r.kv_len) for r in reqs]
    starting = [e for e in entries if not e.start_pos % page_size]
    if starting:
        if kv.sliding is not None:
            _sliding_pages(kv, starting)
            return entries
        fresh = kv.alloc(len(starting))
        if fresh is None:
            raise RuntimeError(f"decode needs {len(starting)} pages that make_room found")
        for e, page in zip(starting, fresh.tolist(), strict=True):
            e.req.pages.append(page)
            e.new_pages = [page]
    return entries


def _sliding_pages(kv: KvManager, starting: list[PlanEntry]) -> None:
    """Each decode that starts a page takes a full page and a sliding page."""
    both = kv.alloc_both(len(starting))
    if both is None:
        raise RuntimeError(f"decode needs {len(starting)} pages that make_room found")
    for e, page, swa in zip(starting, both[0].tolist(), both[1].tolist(), strict=True):
        e.req.pages.append(page)
        e.req.swa_pages.append(swa)
        e.new_pages = [page]
        e.new_swa_pages = [swa]


def decode_rows(
    kv: KvManager,
    reqs: list[Request],
    *,
    drafter: Drafter | None,
    step_id: int,
    context_len: int | None,
) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """(drafted extends, decodes) for ``reqs``, whose plain decode fits:
    drafted rows where ``drafter`` is given (the step drafts) and a source
    has drafts, decodes for the rest."""
    if drafter is None:
        return [], plain_decodes(kv, reqs)
    drafted, plain = plan_drafted_rows(
        kv, reqs, drafter=drafter, step=step_id, context_len=context_len
    )
    return drafted, plain_decodes(kv, plain)


def next_new_token_ratio(
    cfg: SchedulerConfig, ratio: float, running: list[Request], retracted: int
) -> float:
    """After ``retracted`` requests gave up their KV to fit a decode, the
    ratio rises to what the batch left is estimated to need; else it decays."""
    if not retracted:
        return max(ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio)
    decoded = sum(len(r.output_ids) for r in running)
    budget = sum(r.sampling.max_new_tokens for r in running)
    estimate = min(1.0, (decoded + cfg.retract_decode_steps * len(running)) / max(budget, 1))
    ratio = max(ratio, estimate)
    logger.info(
        "retracted requests to fit decode",
        retracted=retracted,
        running=len(running),
        new_token_ratio=round(ratio, 3),
    )
    return ratio


def start_decoding(
    req: Request,
    *,
    drafter: Drafter | None,
    watch: DraftWatch | None,
    max_draft: int,
    pending: int = 1,
) -> None:
    """``req``'s prefill is done and it samples: from now on it decodes (and
    drafts, if it asked to and speculation is on). The table moves it.
    ``pending``: its tokens in flight (0 for a decode unit's request whose
    first token came with its KV, core/disagg/)."""
    req.pending = pending
    if (
        req.spec is None
        and drafter is not None
        and req.speculative
        and req.sampling.grammar is None
    ):
        req.spec = SpecState(max_draft)
    if req.spec is not None and watch is not None:
        watch.add(req)
