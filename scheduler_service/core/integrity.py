"""The scheduler's invariants, checkable at any moment (tests call it after
every step and every update; ``--check-integrity`` makes the service do so)."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.request import ON_WORKER, Place, Request
from scheduler_service.core.request_table import RequestTable


def check_scheduler_integrity(
    kv: KvManager,
    table: RequestTable,
    inflight: Iterable[StepPlan],
    off_worker: Iterable[Request] = (),
) -> None:
    """Every page is exactly one of free, cached-unlocked, or held (by a
    request's own pages or a locked cache node); every live request is in the
    container its place names, holding what that place allows.
    ``off_worker``: requests the worker does not hold that hold pages
    (disaggregation's transfers, core/disagg/)."""
    table.check()
    holders: dict[int, int] = {}
    swa_holders: dict[int, int] = {}
    kv.cache.check_integrity(holders, swa_holders)
    swa_tree = dict(swa_holders)
    for req in table.waiting:
        if req.pages or req.swa_pages or req.last_node is not None or req.pending:
            raise AssertionError(f"waiting request {req.rid} holds KV or tokens in flight")
        if req.waits_for is not None:
            raise AssertionError(f"waiting request {req.rid} still waits for {req.waits_for}")
    for req in table.held:
        if req.pages or req.swa_pages or req.adapter_slot:
            raise AssertionError(f"held request {req.rid} holds KV or an adapter slot")
        if req.waits_for is None:
            raise AssertionError(f"held request {req.rid} waits for nobody")
    drafted: set[str] = set()
    plans = list(inflight)
    for i, plan in enumerate(plans):
        if plan.drafted:
            if i != len(plans) - 1:
                raise AssertionError(f"step {plan.step_id} has drafts and plans after it")
            drafted.update(
                e.req.rid for e in plan.extends if e.drafts is not None and e.req.epoch == e.epoch
            )
    locking = 0
    for req in table.on_worker():
        if req.place is Place.RUNNING:
            # Drafted rows in flight also hold KV positions for their drafts.
            drafts = req.spec.inflight if req.spec is not None else 0
            if req.kv_len != req.num_tokens + req.pending - 1 + drafts:
                raise AssertionError(
                    f"{req.rid}: kv_len {req.kv_len} != tokens {req.num_tokens} + pending "
                    f"{req.pending} - 1 + drafts in flight {drafts}"
                )
            if drafts and (req.pending != 1 or req.rid not in drafted):
                raise AssertionError(f"{req.rid}: {drafts} drafts in flight, no drafted plan")
        elif req.pending:
            raise AssertionError(f"{req.place.value} request {req.rid} has tokens in flight")
        kv.add_request_holdings(req, holders, swa_holders)
        if req.last_node is not None and req.last_node.parent is not None:
            locking += 1
    for req in off_worker:
        kv.add_request_holdings(req, holders, swa_holders)
        if req.last_node is not None and req.last_node.parent is not None:
            locking += 1
    for req in table:
        if req.place not in ON_WORKER and req.adapter_slot:
            raise AssertionError(f"{req.place.value} request {req.rid} holds adapter slot")
    locks = sum(c.lock_ref for root in kv.cache.roots() for c in root.children.values())
    locking += kv.cache.transfer_locks  # host-tier copies in flight (kv/host_transfers.py)
    if locks != locking:
        raise AssertionError(f"cache holds {locks} locks, requests and copies hold {locking}")
    kv.pool.check_integrity(holders)
    if kv.sliding is not None:
        kv.sliding.check_integrity(swa_holders, swa_tree)
