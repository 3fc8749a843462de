"""What the scheduler does with its requests when the worker group is lost
with its KV pages (``Scheduler.reset_after_worker_loss``): every request's
tokens are still here, so each one that held KV goes back to wait with the
output it has, exactly like a retracted one, and what any request read from
the cache, which is dropped, will be read or computed again."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.ids import id_array
from scheduler_service.core.inflight import InFlight
from scheduler_service.core.outputs import SchedulerStats
from scheduler_service.core.request import Request, RequestState


def take_kv_holders(
    running: RunningBatch, chunked: Request | None, inflight: Iterable[InFlight]
) -> list[Request]:
    """The requests that hold KV: running (taken out of the batch here),
    chunked (the caller forgets it), and those with max_new_tokens == 0
    whose prefill is in flight (they sit in no queue: only the in-flight
    record knows them)."""
    holders: list[Request] = running.reqs()
    if chunked is not None:
        holders.append(chunked)
    for rec in inflight:
        holders.extend(
            r
            for r, epoch in rec.prefill_only
            if r.epoch == epoch and r.state is RequestState.PREFILLING
        )
    for req in running.reqs():
        running.remove(req)
    return holders


def send_back_to_wait(holders: list[Request], waiting: list[Request], now: float) -> None:
    """Forget the KV of ``holders`` and queue them, the oldest first, ahead of
    the requests that never ran (the caller took them out of the batch)."""
    for req in holders:
        # No release: the pool and the cache are wiped, and inserting pages
        # whose contents are gone would poison the cache.
        req.forget_kv()
        req.on_worker = False
        req.adapter_slot = 0
        req.back_to_wait(now)  # anything still arriving for the old plans is stale
    holders.sort(key=lambda r: r.times.arrival)
    waiting[:0] = holders


def forget_cache_reads(
    waiting: list[Request], requests: Mapping[str, Request], stats: SchedulerStats
) -> None:
    """The cache is dropped: waiting requests' matches point into it, and what
    every request read from it is gone and will be computed again (the next
    admission counts their hits afresh)."""
    for req in waiting:
        req.match_pages, req.match_node, req.match_len = id_array(), None, 0
    for req in requests.values():
        stats.cached_tokens -= req.cached_tokens
        req.cached_tokens = 0
        req.cache_hits_counted = False
