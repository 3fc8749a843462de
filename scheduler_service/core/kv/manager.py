"""Who holds which KV page: a request's table, the radix cache, or the free list.

A running request's page table is always shaped::

    pages = [ tree pages (locked via last_node) | own pages ]
              ^ 0            tree_pages ^                ^ len(pages)

Tree pages are shared through the radix cache and kept alive by the lock on
``last_node``; own pages are the request's alone. Tables only grow on the
worker (plans append page ids), so a request never swaps a page under its
own table: where another request cached the same tokens first, the tree
region holds this request's duplicate instead of the cache's page
(``req.dup_pages``, in table order). Duplicates are the request's own and go
back to the pool when it releases them; the pages after them still enter the
cache (a request that computed a cached prefix again, e.g. for its prompt
logprobs, shares the rest of its prompt with the requests after it).

KV of position p is "valid" once a plan that computes it has been created:
the worker runs plans in order, so any later plan that reads it (through the
cache) runs after the write.
"""

from __future__ import annotations

from array import array

from scheduler_service.core.ids import id_array
from scheduler_service.core.kv.id_runs import differing_pages
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache, RadixNode
from scheduler_service.core.request import Request


class KvManager:
    def __init__(self, pool: PagePool, cache: RadixCache) -> None:
        self.pool = pool
        self.cache = cache
        self.page_size = pool.page_size

    # ------------------------------------------------------------ budget
    def available_pages(self) -> int:
        """Pages that could be handed out now: free plus evictable."""
        return self.pool.num_free + self.cache.evictable_pages

    def pages_for(self, req: Request, kv_len: int) -> int:
        """New pages ``req`` needs so its table covers positions [0, kv_len)."""
        return max(0, -(-kv_len // self.page_size) - len(req.pages))

    def alloc(self, n: int) -> array | None:
        """n pages, evicting unlocked cache leaves if the free list is short."""
        if n <= 0:
            return id_array()
        short = n - self.pool.num_free
        if short > 0:
            if short > self.cache.evictable_pages:
                return None
            self.cache.evict(short)
        return self.pool.alloc(n)

    # ------------------------------------------------------ request life
    def attach_prefix(self, req: Request, pages: array, length: int, node: RadixNode) -> None:
        """Start ``req``'s table with a cached prefix (the caller locked ``node``)."""
        assert not req.pages and req.last_node is None
        req.pages = id_array(pages)
        req.tree_pages = len(pages)
        req.last_node = node
        req.kv_len = length

    def grow(self, req: Request, kv_len: int) -> array | None:
        """Extend ``req``'s table to cover [0, kv_len); None if memory is short."""
        new = self.alloc(self.pages_for(req, kv_len))
        if new:
            req.pages.extend(new)
        return new

    def trim(self, req: Request) -> None:
        """Free ``req``'s pages past ceil(kv_len / page_size) (a drafted step
        whose drafts were not all accepted: the worker truncates alike)."""
        keep = -(-req.kv_len // self.page_size)
        if keep < len(req.pages):
            if keep < req.tree_pages:
                raise RuntimeError(f"request {req.rid}: trim into its cached pages")
            self.pool.release(req.pages[keep:])
            del req.pages[keep:]

    def cache_computed_prefix(self, req: Request) -> None:
        """Share ``req``'s computed full pages through the cache while it runs.

        Where the cache already holds those tokens under other pages, the
        request keeps using its own copies (``dup_pages``) until it is
        released; the cache takes the pages past them.
        """
        page_size = self.page_size
        n_pages = min(req.kv_len, req.num_tokens) // page_size
        if n_pages <= req.tree_pages:
            return
        tokens = req.token_array()
        result = self.cache.insert(
            tokens[: n_pages * page_size], req.pages[:n_pages], req.extra_key
        )
        if result.dup_pages and result.prefix_len >= n_pages * page_size:
            # The cache held all of it already: taking its path would pin its
            # copies beside this request's and share nothing new (a request
            # re-admitted after a retraction recomputes its last page; doing
            # so again after every retraction was a livelock). It keeps its
            # copies as its own pages.
            return
        # The whole key was inserted again: its duplicates are the old ones
        # (the locked path did not change) plus those of the new pages.
        req.dup_pages = result.dup_pages
        self.cache.lock(result.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = result.node
        req.tree_pages = n_pages

    def release(self, req: Request) -> None:
        """Give back everything ``req`` holds: its valid full pages go into
        the radix cache (unlocked, so evictable) for later requests with the
        same prefix; duplicates of pages the cache already has are freed.
        """
        pool, cache = self.pool, self.cache
        pages = req.pages
        own_from = req.tree_pages
        dups = req.dup_pages
        n_pages = min(req.kv_len, req.num_tokens) // self.page_size
        if n_pages > req.tree_pages:
            tokens = req.token_array()
            result = cache.insert(
                tokens[: n_pages * self.page_size], pages[:n_pages], req.extra_key
            )
            dups = result.dup_pages  # the old duplicates and the new ones
            own_from = n_pages
        pool.release(dups)
        pool.release(pages[own_from:])
        if req.last_node is not None:
            cache.unlock(req.last_node)
        req.pages = id_array()
        req.tree_pages = 0
        req.dup_pages = id_array()
        req.last_node = None
        req.kv_len = 0

    # --------------------------------------------------------- invariants
    def add_request_holdings(self, req: Request, holders: dict[int, int]) -> None:
        """Count ``req``'s own pages in ``holders`` and check its table's shape."""
        page_size = self.page_size
        if len(req.pages) != -(-req.kv_len // page_size):
            raise AssertionError(
                f"request {req.rid}: {len(req.pages)} pages for kv_len {req.kv_len} "
                f"(page size {page_size})"
            )
        for p in req.pages[req.tree_pages :]:
            holders[p] = holders.get(p, 0) + 1
        for p in req.dup_pages:
            holders[p] = holders.get(p, 0) + 1
        path: list[array] = []
        node = req.last_node
        while node is not None and node.parent is not None:
            if node.lock_ref < 1:
                raise AssertionError(f"request {req.rid} holds an unlocked cache node")
            path.append(node.pages)
            node = node.parent
        tree_pages = id_array()
        for seg in reversed(path):
            tree_pages += seg
        mine = req.pages[: req.tree_pages]
        if len(tree_pages) != len(mine) or differing_pages(mine, tree_pages) != req.dup_pages:
            raise AssertionError(
                f"request {req.rid}: its first {req.tree_pages} pages are not the cache path "
                "it locked (its duplicates aside)"
            )
