"""What a lost worker group means for the scheduler's requests
(``Scheduler.reset_after_worker_loss``): every request's tokens are still
here, so each one the worker held goes back to wait with the output it has,
exactly like a retracted one (the request table moves them), its KV is
forgotten without being given back (the pool and the cache are wiped, and
inserting pages whose contents are gone would poison the cache), and what
any request read from the cache, which is dropped, will be read or computed
again."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_service.core.ids import id_array
from scheduler_service.core.request import Place, Request


def forget_worker_state(lost: Iterable[Request]) -> None:
    """The KV of the requests the lost worker held is gone with it."""
    for req in lost:
        req.forget_kv()


def forget_cache_reads(requests: Iterable[Request]) -> int:
    """The cache is dropped: waiting requests' matches point into it, and what
    every request read from it is gone and will be computed again (the next
    admission counts their hits afresh). Returns the cached tokens no longer
    counted."""
    forgotten = 0
    for req in requests:
        if req.place is Place.WAITING:
            req.match_pages, req.match_node, req.match_len = id_array(), None, 0
            req.match_swa = None
            req.match_host_len, req.match_host_node = 0, None
        forgotten += req.cached_tokens
        req.cached_tokens = 0
        req.cache_hits_counted = False
    return forgotten
