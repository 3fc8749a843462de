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
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
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


def resize_pools(
    kv: KvManager,
    num_pages: int,
    num_swa_pages: int,
    *,
    host: PagePool | None = None,
    num_host_pages: int = 0,
) -> None:
    """The pools take the page counts of the worker group that came back;
    only while nothing holds KV. ``num_swa_pages``: its sliding pool (0:
    none), which it must have exactly when the scheduler has one;
    ``num_host_pages``: its host pool, which it must have when the scheduler
    has a host tier (``host``; one the scheduler does not use is harmless:
    it is sent no copies)."""
    if kv.pool.num_free != kv.pool.num_pages or kv.cache.cached_pages:
        raise RuntimeError("the page pool can only be resized while it is empty")
    if (num_swa_pages > 0) != (kv.sliding is not None):
        raise RuntimeError(
            f"the worker group came back with {num_swa_pages} sliding pages; "
            f"this scheduler {'has' if kv.sliding is not None else 'has no'} sliding pool"
        )
    if host is not None and num_host_pages < 1:
        raise RuntimeError(
            "the worker group came back without a host KV pool; this scheduler "
            "plans host copies (restart it to serve without the host tier)"
        )
    kv.pool.reset(num_pages)
    if kv.sliding is not None:
        kv.sliding.reset(num_swa_pages)
    if host is not None:
        host.reset(num_host_pages)
