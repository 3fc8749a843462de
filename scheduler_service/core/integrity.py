"""The scheduler's invariants, checkable at any moment (tests call it after
every step and every update)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_service.core.request import Request, RequestState

if TYPE_CHECKING:
    from scheduler_service.core.scheduler import Scheduler


def check_scheduler_integrity(sched: Scheduler) -> None:
    """Every page is exactly one of free, cached-unlocked, or held (by a
    request's own pages or a locked cache node); every live request is in
    exactly one place, in a state that fits it."""
    holders: dict[int, int] = {}
    sched.cache.check_integrity(holders)
    placed: dict[str, str] = {}

    def place(req: Request, where: str) -> None:
        if req.rid in placed:
            raise AssertionError(f"{req.rid} is both {placed[req.rid]} and {where}")
        if sched.requests.get(req.rid) is not req:
            raise AssertionError(f"{req.rid} ({where}) is not a live request")
        placed[req.rid] = where

    locking = 0
    for req in sched.waiting:
        place(req, "waiting")
        if req.state not in (RequestState.WAITING, RequestState.RETRACTED):
            raise AssertionError(f"waiting request {req.rid} is {req.state}")
        if req.pages or req.last_node is not None or req.pending:
            raise AssertionError(f"waiting request {req.rid} holds KV or tokens in flight")
    holding = [(r, "running") for r in sched.running]
    if sched.chunked is not None:
        holding.append((sched.chunked, "chunked"))
    for rec in sched._inflight:
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
        sched.kv.add_request_holdings(req, holders)
        if req.last_node is not None and req.last_node.parent is not None:
            locking += 1
    missing = set(sched.requests) - set(placed)
    if missing:
        raise AssertionError(f"live requests nowhere to be found: {sorted(missing)[:5]}")
    locks = sum(c.lock_ref for root in sched.cache.roots() for c in root.children.values())
    if locks != locking:
        raise AssertionError(f"cache holds {locks} request locks, requests hold {locking}")
    sched.pool.check_integrity(holders)
