"""Planning drafted rows (speculative decoding, docs/design.md).

A running request that drafts d[0..k-1] gets an extend entry instead of a
decode: ``input_ids = [its last sampled token] + d`` from ``start_pos =
kv_len``, with pages for all k + 1 positions. Drafts only use the pages
left once the plain decode of every candidate fits (make_room
in decode.py retracts for those, never for drafts): a request short of
pages drafts less, or not at all.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.plan import PlanEntry
from scheduler_service.core.request import Request
from scheduler_service.core.spec.drafts import Drafter
from scheduler_service.core.spec.state import SpecState


def draft_limit(req: Request, state: SpecState, context_len: int | None) -> int:
    """Most drafts ``req`` may take now: its adaptive k, and room for the
    k + 1 tokens within max_new_tokens and the context length (counting
    tokens still in flight)."""
    planned = len(req.output_ids) + req.pending
    limit = min(state.k, req.sampling.max_new_tokens - planned - 1)
    if context_len is not None:
        limit = min(limit, context_len - len(req.prompt_ids) - planned - 1)
    return limit


class DraftWatch:
    """Which running requests want drafts, without looking at every request
    every step: active ones (k > 0) are asked each step; dormant ones wait in
    a heap by the step they look for a match again (state.py), so a
    batch of random text costs nothing in the steps between."""

    def __init__(self, drafter: Drafter, context_len: int | None) -> None:
        self.drafter = drafter
        self.context_len = context_len
        self._active: dict[str, Request] = {}
        self._heap: list[tuple[int, int, Request]] = []
        self._seq = 0

    def add(self, req: Request) -> None:
        """``req`` (with a SpecState) joined the running batch."""
        self._active.pop(req.rid, None)
        self._push(req, req.spec.wake_at)

    def _push(self, req: Request, at: int) -> None:
        self._seq += 1
        req.spec.watch = self._seq  # older heap entries of req are void
        heapq.heappush(self._heap, (at, self._seq, req))

    def wants(self, running: Mapping[str, Request], step: int) -> bool:
        """Whether a running request (``running``: by rid) wants to draft now;
        wakes the dormant ones that are due and whose sources have a match."""
        heap, active, drafter = self._heap, self._active, self.drafter
        if not running:  # whatever is left belongs to requests gone
            heap.clear()
            active.clear()
            return False
        while heap and heap[0][0] <= step:
            _, seq, req = heapq.heappop(heap)
            s = req.spec
            if s.watch != seq or running.get(req.rid) is not req:
                continue
            if not s.k:
                if step < s.wake_at:
                    self._push(req, s.wake_at)
                    continue
                if not drafter.propose(req, s, 1):
                    s.recheck_later(step)
                    self._push(req, s.wake_at)
                    continue
                s.wake()
            s.watch = 0
            active[req.rid] = req
        want = False
        gone: list[Request] = []
        for req in active.values():
            s = req.spec
            if running.get(req.rid) is not req or not s.k:
                gone.append(req)
            elif not want and draft_limit(req, s, self.context_len) > 0:
                want = True
        for req in gone:
            del active[req.rid]
            if running.get(req.rid) is req:  # dormant again
                self._push(req, req.spec.wake_at)
        return want


def plan_drafted_rows(
    kv: KvManager,
    reqs: list[Request],
    *,
    drafter: Drafter,
    step: int,
    context_len: int | None,
) -> tuple[list[PlanEntry], list[Request]]:
    """Drafted extends for those of ``reqs`` (nothing of theirs in flight,
    their plain decode known to fit) where a source has drafts and pages
    allow, and the requests left to decode plainly."""
    page_size = kv.page_size
    spare = kv.available_pages() - sum(1 for r in reqs if r.kv_len % page_size == 0)
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
    entries: list[PlanEntry] = []
    for r, drafts in chosen:
        pos = r.kv_len
        k = len(drafts)
        fresh = kv.grow(r, pos + k + 1)
        if fresh is None:
            raise RuntimeError(f"{r.rid}: drafted pages that were counted are not there")
        inputs = [r.output_ids[-1], *drafts]
        entry = PlanEntry(
            r, r.epoch, pos, inputs, new_pages=fresh.tolist(), sample=True, drafts=drafts
        )
        if kv.sliding is not None:
            entry.new_swa_pages = kv.new_swa(r, len(r.pages) - len(fresh)).tolist()
        entries.append(entry)
        r.kv_len = pos + k + 1
        r.pending += 1
        r.spec.inflight = k
    return entries, plain


__all__ = ["DraftWatch", "draft_limit", "plan_drafted_rows"]
