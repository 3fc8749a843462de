"""After a drafted plan's result was applied (results.py received its tokens
and set each request's kv_len to what the worker kept): each request's
adaptive k learns what was accepted, and its pages past the accepted tokens
go back at once (the worker truncates alike)."""

from __future__ import annotations

from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.plan import StepPlan


def settle_drafts(plan: StepPlan, kv: KvManager, step: int) -> None:
    for e in plan.extends:
        if e.drafts is None:
            continue
        req = e.req
        if req.epoch == e.epoch:  # not aborted meanwhile
            req.spec.inflight = 0
            req.spec.verified(len(e.drafts), req.kv_len - e.start_pos - 1, step)
            kv.trim(req)
