"""The scheduler's invariants, checkable at any moment (tests call it after
every step and every update; ``--check-integrity`` makes the service do so)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduler_service.core.inflight import InFlight
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.request import Request, RequestState

_EXPECTED_STATE = {
    "running": RequestState.DECODING,
    "chunked": RequestState.PREFILLING,
    "prefill-only": RequestState.PREFILLING,
}


def check_scheduler_integrity(
    kv: KvManager,
    requests: Mapping[str, Request],
    waiting: Iterable[Request],
    held: Iterable[Request],
    running: Iterable[Request],
    chunked: Request | None,
    inflight: Iterable[InFlight],
) -> None:
    """Every page is exactly one of free, cached-unlocked, or held (by a
    request's own pages or a locked cache node); every live request is in
    exactly one place, in a state that fits it."""
    holders: dict[int, int] = {}
    kv.cache.check_integrity(holders)
    placed: dict[str, str] = {}

    def place(req: Request, where: str) -> None:
        if req.rid in placed:
            raise AssertionError(f"{req.rid} is both {placed[req.rid]} and {where}")
        if requests.get(req.rid) is not req:
            raise AssertionError(f"{req.rid} ({where}) is not a live request")
        placed[req.rid] = where

    for req in waiting:
        place(req, "waiting")
        if req.state not in (RequestState.WAITING, RequestState.RETRACTED):
            raise AssertionError(f"waiting request {req.rid} is {req.state}")
        if req.pages or req.last_node is not None or req.pending:
            raise AssertionError(f"waiting request {req.rid} holds KV or tokens in flight")
        if req.waits_for is not None:
            raise AssertionError(f"waiting request {req.rid} still waits for {req.waits_for}")
    for req in held:
        place(req, "held")
        if req.state is not RequestState.WAITING or req.pages or req.on_worker:
            raise AssertionError(f"held request {req.rid} is {req.state} or holds KV")
        if req.waits_for is None:
            raise AssertionError(f"held request {req.rid} waits for nobody")
    holding = [(r, "running") for r in running]
    if chunked is not None:
        holding.append((chunked, "chunked"))
    for rec in inflight:
        holding.extend((r, "prefill-only") for r, e in rec.prefill_only if r.epoch == e)
    drafted: set[str] = set()
    records = list(inflight)
    for i, rec in enumerate(records):
        if rec.drafts:
            if i != len(records) - 1:
                raise AssertionError(f"step {rec.step_id} has drafts and plans after it")
            drafted.update(rid for rid, d in rec.drafts.items() if d[0].epoch == d[1])
    locking = 0
    for req, where in holding:
        place(req, where)
        if req.state is not _EXPECTED_STATE[where]:
            raise AssertionError(f"{where} request {req.rid} is {req.state}")
        if where == "running":
            # Drafted rows in flight also hold KV positions for their drafts.
            drafts = req.spec.inflight if req.spec is not None else 0
            if req.kv_len != req.num_tokens + req.pending - 1 + drafts:
                raise AssertionError(
                    f"{req.rid}: kv_len {req.kv_len} != tokens {req.num_tokens} + pending "
                    f"{req.pending} - 1 + drafts in flight {drafts}"
                )
            if drafts and (req.pending != 1 or req.rid not in drafted):
                raise AssertionError(f"{req.rid}: {drafts} drafts in flight, no drafted plan")
        kv.add_request_holdings(req, holders)
        if req.last_node is not None and req.last_node.parent is not None:
            locking += 1
    missing = set(requests) - set(placed)
    if missing:
        raise AssertionError(f"live requests nowhere to be found: {sorted(missing)[:5]}")
    locks = sum(c.lock_ref for root in kv.cache.roots() for c in root.children.values())
    if locks != locking:
        raise AssertionError(f"cache holds {locks} request locks, requests hold {locking}")
    kv.pool.check_integrity(holders)
