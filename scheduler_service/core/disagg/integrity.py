"""check_disagg: the disaggregation records against the request table (the
scheduler's integrity check counts the pages they hold: ``holders``)."""

from __future__ import annotations

from scheduler_service.core.disagg.transfer import Transfer
from scheduler_service.core.request import ON_WORKER, PARKED, Place
from scheduler_service.core.request_table import RequestTable

_ROLE_PLACES = {
    "prefill": frozenset({Place.BOOTSTRAPPING, Place.SENDING}),
    "decode": frozenset({Place.PREALLOC, Place.RECEIVING}),
}


def check_disagg(
    mode: str,
    table: RequestTable,
    *,
    transfers: dict[str, Transfer],
    closing: dict[str, Transfer],
    page_size: int,
) -> None:
    """Every parked request has its record and holds what its place allows;
    every record is a live request's, once per room; closing transfers are
    finished requests the table no longer has, whose pages the engine holds."""
    allowed = _ROLE_PLACES[mode]
    prefill = mode == "prefill"
    for rid, req in table.parked.items():
        if req.place not in allowed:
            raise AssertionError(f"{rid} is {req.place.value} on a {mode} unit")
        if rid not in transfers:
            raise AssertionError(f"parked {rid} ({req.place.value}) has no transfer record")
    rooms = set()
    for rid, t in transfers.items():
        req = t.req
        if rid != req.rid or table.get(rid) is not req:
            raise AssertionError(f"transfer record {rid} is no live request's")
        if t.room in rooms or req.bootstrap is None or req.bootstrap.room != t.room:
            raise AssertionError(f"{rid}: room {t.room} twice, or not the request's")
        rooms.add(t.room)
        place = req.place
        prompt_len = len(req.prompt_ids)
        if t.engine_holds and place not in (Place.SENDING, Place.RECEIVING):
            raise AssertionError(f"{rid}: the engine holds the pages of a {place.value} request")
        if place in (Place.BOOTSTRAPPING, Place.PREALLOC):
            if req.pages or req.last_node is not None or req.pending or req.output_ids:
                raise AssertionError(f"{place.value} {rid} holds KV, tokens or outputs")
        elif place is Place.SENDING:
            if req.pending or len(req.output_ids) != 1 or req.kv_len != prompt_len:
                raise AssertionError(
                    f"sending {rid}: pending {req.pending}, {len(req.output_ids)} outputs, "
                    f"kv_len {req.kv_len} for a {prompt_len}-token prompt"
                )
            if t.reason is None or not t.engine_holds:
                raise AssertionError(f"sending {rid} without its finish or its order")
        elif place is Place.RECEIVING:
            if req.pending or req.kv_len != prompt_len or len(req.output_ids) != t.received:
                raise AssertionError(
                    f"receiving {rid}: pending {req.pending}, kv_len {req.kv_len}, "
                    f"{len(req.output_ids)} outputs, received {t.received}"
                )
            if t.prefix_len % page_size or t.prefix_len != req.tree_pages * page_size:
                raise AssertionError(f"receiving {rid}: prefix {t.prefix_len} is not its match")
        elif not prefill or place not in ON_WORKER | {Place.WAITING}:
            # A prefill unit's request computes here between its peer's claim
            # and its first token; a decode unit's leaves its record on landing.
            raise AssertionError(f"{rid} has a transfer record while {place.value}")
    for rid, t in closing.items():
        if rid in table or not t.req.finished or rid in transfers:
            raise AssertionError(f"closing transfer {rid} is live, or not finished")
    if any(r.place in PARKED for r in table.waiting):
        raise AssertionError("a parked request in the queue")


__all__ = ["check_disagg"]
