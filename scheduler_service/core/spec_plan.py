"""Planning drafted rows (speculative decoding, docs/design.md).

A running request that drafts d[0..k-1] gets an extend entry instead of a
decode: ``input_ids = [its last sampled token] + d`` from ``start_pos =
kv_len``, with pages for all k + 1 positions. Drafts only use the pages
left once the plain decode of every candidate fits (make_room_for_decode
retracts for those, never for drafts): a request short of pages drafts
less, or not at all.
"""

from __future__ import annotations

from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.drafts import Drafter
from scheduler_service.core.kv_manager import KvManager
from scheduler_service.core.plan import ScheduledRequest
from scheduler_service.core.request import Request
from scheduler_service.core.spec_state import SpecState

NEVER = 1 << 62
# rid -> (request, epoch, start_pos, drafts): InFlight.drafts
Drafts = dict[str, tuple[Request, int, int, list[int]]]


def draft_limit(req: Request, state: SpecState, context_len: int | None) -> int:
    """Most drafts ``req`` may take now: its adaptive k, and room for the
    k + 1 tokens within max_new_tokens and the context length (counting
    tokens still in flight)."""
    planned = len(req.output_ids) + req.pending
    limit = min(state.k, req.sampling.max_new_tokens - planned - 1)
    if context_len is not None:
        limit = min(limit, context_len - len(req.prompt_ids) - planned - 1)
    return limit


def wants_drafts(
    running: RunningBatch, drafter: Drafter, step: int, context_len: int | None
) -> tuple[bool, int]:
    """Whether a running request wants to draft now, waking dormant requests
    whose sources found a match (see spec_state.py); and the next step at
    which asking again can change the answer (the nearest wake-up when all
    are dormant: random text costs nothing in the steps between)."""
    want = False
    next_check = NEVER
    for r in running:
        s = r.spec
        if s is None:
            continue
        if not s.k:
            if step < s.wake_at:
                next_check = min(next_check, s.wake_at)
                continue
            if drafter.propose(r, s, 1):
                s.wake()
            else:
                s.recheck_later(step)
                next_check = min(next_check, s.wake_at)
                continue
        next_check = step  # an active request: ask every step
        if draft_limit(r, s, context_len) > 0:
            want = True
    return want, next_check


def plan_decode_rows(
    running: RunningBatch,
    kv: KvManager,
    reqs: list[Request],
    drafter: Drafter,
    step: int,
    context_len: int | None,
) -> tuple[list[ScheduledRequest], Drafts]:
    """Entries for ``reqs`` (nothing of theirs in flight, their plain decode
    known to fit): drafted extends where a source has drafts and pages allow,
    decodes for the rest."""
    page_size = kv.page_size
    spare = kv.available_pages() - running.pages_needed(reqs)
    plain: list[Request] = []
    chosen: list[tuple[Request, list[int]]] = []
    for r in reqs:
        s = r.spec
        if s is None or not s.k or r.pending:  # drafts need the last token known
            plain.append(r)
            continue
        limit = draft_limit(r, s, context_len)
        drafts = drafter.propose(r, s, limit) if limit > 0 else []
        if not drafts:
            if limit > 0:
                s.no_match(step)
            plain.append(r)
            continue
        own = 1 if r.kv_len % page_size == 0 else 0  # the page its decode would take
        fit = (len(r.pages) + own + spare) * page_size - r.kv_len - 1
        if fit < len(drafts):
            drafts = drafts[: max(fit, 0)]
            if not drafts:
                plain.append(r)
                continue
        spare -= kv.pages_for(r, r.kv_len + len(drafts) + 1) - own
        chosen.append((r, drafts))
    entries: list[ScheduledRequest] = []
    planned: Drafts = {}
    for r, drafts in chosen:
        pos = r.kv_len
        k = len(drafts)
        fresh = kv.grow(r, pos + k + 1)
        if fresh is None:
            raise RuntimeError(f"{r.rid}: drafted pages that were counted are not there")
        entries.append(
            ScheduledRequest(r.rid, pos, [r.output_ids[-1], *drafts], fresh.tolist(), True, None, k)
        )
        r.kv_len = pos + k + 1
        r.pending += 1
        r.spec.inflight = k
        planned[r.rid] = (r, r.epoch, pos, drafts)
    entries += running.prepare_decode(plain)
    return entries, planned


__all__ = ["Drafts", "draft_limit", "plan_decode_rows", "wants_drafts"]
