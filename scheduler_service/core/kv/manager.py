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

With a sliding pool (kv/sliding.py) every new page of a table comes with a
sliding page (``swa_pages``, parallel), every budget is the smaller of the
two pools', and ``slide`` frees the sliding pages no future query can see
once the step that advanced ``kv_len`` is planned (never within it: a page
freed while a plan is being built could be written by another request of
the same forward before this one reads it).
"""

from __future__ import annotations

from array import array

from scheduler_service.core.ids import id_array, zero_pages
from scheduler_service.core.kv.id_runs import differing_pages
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache, RadixNode
from scheduler_service.core.kv.sliding import NULL_PAGE, SlidingPages, freeable_below
from scheduler_service.core.request import Request


class KvManager:
    def __init__(
        self, pool: PagePool, cache: RadixCache, sliding: SlidingPages | None = None
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.page_size = pool.page_size
        self.sliding = sliding

    # ------------------------------------------------------------ budget
    def available_pages(self) -> int:
        """Pages that could be handed out now: free plus evictable (in both
        pools: each new page of a table takes one of each)."""
        full = self.pool.num_free + self.cache.evictable_pages
        sliding = self.sliding
        if sliding is None:
            return full
        return min(full, sliding.num_free + sliding.tree_only)

    def swa_available_pages(self) -> int:
        """Sliding pages that could be handed out now (free plus evictable)."""
        sliding = self.sliding
        return sliding.num_free + sliding.tree_only if sliding is not None else 0

    def pages_for(self, req: Request, kv_len: int) -> int:
        """New pages ``req`` needs so its table covers positions [0, kv_len)."""
        return max(0, -(-kv_len // self.page_size) - len(req.pages))

    def alloc(self, n: int) -> array | None:
        """n pages, evicting unlocked cache leaves if the free list is short
        (the full pool's; with a sliding pool, see ``alloc_both``)."""
        if n <= 0:
            return id_array()
        short = n - self.pool.num_free
        if short > 0:
            if short > self.cache.evictable_pages:
                return None
            self.cache.evict(short)
        return self.pool.alloc(n)

    def alloc_both(self, n: int) -> tuple[array, array] | None:
        """n full pages and n sliding pages, or None (nothing taken) if either
        pool is short even after eviction."""
        sliding = self.sliding
        if n > sliding.num_free + sliding.tree_only:
            return None
        full = self.alloc(n)
        if full is None:
            return None
        short = n - sliding.num_free
        if short > 0:  # evicting full leaves above may have freed some already
            self.cache.evict_swa(short)
        swa = sliding.alloc(n)
        if swa is None:
            raise RuntimeError(f"{n} sliding pages were counted and are not there")
        return full, swa

    # ------------------------------------------------------ request life
    def attach_prefix(
        self,
        req: Request,
        pages: array,
        length: int,
        node: RadixNode,
        *,
        swa: array | None = None,
    ) -> None:
        """Start ``req``'s table with a cached prefix (the caller locked ``node``)."""
        assert not req.pages and req.last_node is None
        req.pages = id_array(pages)
        req.tree_pages = len(pages)
        req.last_node = node
        req.kv_len = length
        sliding = self.sliding
        if sliding is not None:
            # It reads only the last window of the prefix: it holds those
            # pages (the match guarantees they are cached), not the rest.
            lo = freeable_below(length, sliding.window, self.page_size)
            swa = id_array(swa if swa is not None else ())
            if len(swa) != len(pages):
                raise RuntimeError(f"{req.rid}: a match without its sliding entries")
            swa[:lo] = zero_pages(lo)
            if NULL_PAGE in swa[lo:]:
                raise RuntimeError(f"{req.rid}: a match whose window is not cached")
            sliding.share(swa[lo:])
            req.swa_pages = swa
            req.swa_freed = lo

    def grow(self, req: Request, kv_len: int) -> array | None:
        """Extend ``req``'s table to cover [0, kv_len); None if memory is short."""
        if self.sliding is not None:
            both = self.alloc_both(self.pages_for(req, kv_len))
            if both is None:
                return None
            new, swa = both
            req.swa_pages.extend(swa)
        else:
            new = self.alloc(self.pages_for(req, kv_len))
        if new:
            req.pages.extend(new)
        return new

    def new_swa(self, req: Request, known: int) -> array | tuple[()]:
        """The sliding entries of ``req``'s table from page ``known`` on
        (what a plan appends to the worker's sliding table); () without a
        sliding pool."""
        return req.swa_pages[known:] if self.sliding is not None else ()

    def swa_attach_cost(self, req: Request) -> int:
        """Evictable sliding pages that attaching ``req``'s match would take
        (cached pages of its window no request holds yet)."""
        swa = req.match_swa
        if not swa:
            return 0
        sliding = self.sliding
        lo = freeable_below(req.match_len, sliding.window, self.page_size)
        is_tree_only = sliding.is_tree_only
        return sum(1 for p in swa[lo:] if p and is_tree_only(p))

    def slide(self, req: Request) -> None:
        """Free ``req``'s sliding pages that no query at or after its KV end
        can see (their entries become 0). Drafts in flight may be rejected,
        which moves the end back: only what stays invisible from the
        earliest end the worker can return is freed."""
        sliding = self.sliding
        kv_len = req.kv_len
        if req.spec is not None:
            kv_len -= req.spec.inflight
        upto = freeable_below(kv_len, sliding.window, self.page_size)
        lo = req.swa_freed
        if upto <= lo:
            return
        swa = req.swa_pages
        sliding.release(swa[lo:upto])
        swa[lo:upto] = zero_pages(upto - lo)
        req.swa_freed = upto

    def trim(self, req: Request) -> None:
        """Free ``req``'s pages past ceil(kv_len / page_size) (a drafted step
        whose drafts were not all accepted: the worker truncates alike)."""
        keep = -(-req.kv_len // self.page_size)
        if keep < len(req.pages):
            if keep < req.tree_pages:
                raise RuntimeError(f"request {req.rid}: trim into its cached pages")
            self.pool.release(req.pages[keep:])
            del req.pages[keep:]
            if self.sliding is not None:
                self.sliding.release(req.swa_pages[keep:])
                del req.swa_pages[keep:]

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
        swa = req.swa_pages[:n_pages] if self.sliding is not None else None
        result = self.cache.insert(
            tokens[: n_pages * page_size], req.pages[:n_pages], req.extra_key, swa=swa
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
            swa = req.swa_pages[:n_pages] if self.sliding is not None else None
            result = cache.insert(
                tokens[: n_pages * self.page_size], pages[:n_pages], req.extra_key, swa=swa
            )
            dups = result.dup_pages  # the old duplicates and the new ones
            own_from = n_pages
        pool.release(dups)
        pool.release(pages[own_from:])
        if req.last_node is not None:
            cache.unlock(req.last_node)
        if self.sliding is not None:
            self.sliding.release(req.swa_pages)  # the cache took its own references
            req.swa_pages = id_array()
            req.swa_freed = 0
        req.pages = id_array()
        req.tree_pages = 0
        req.dup_pages = id_array()
        req.last_node = None
        req.kv_len = 0

    # --------------------------------------------------------- invariants
    def add_request_holdings(
        self, req: Request, holders: dict[int, int], swa_holders: dict[int, int] | None = None
    ) -> None:
        """Count ``req``'s own pages in ``holders`` (its sliding references
        in ``swa_holders``) and check its tables' shape."""
        page_size = self.page_size
        if len(req.pages) != -(-req.kv_len // page_size):
            raise AssertionError(
                f"request {req.rid}: {len(req.pages)} pages for kv_len {req.kv_len} "
                f"(page size {page_size})"
            )
        if self.sliding is not None:
            self._check_sliding_table(req, swa_holders if swa_holders is not None else {})
        elif req.swa_pages:
            raise AssertionError(f"request {req.rid}: a sliding table without a sliding pool")
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

    def _check_sliding_table(self, req: Request, swa_holders: dict[int, int]) -> None:
        """Parallel to the full table; 0 exactly where allowed: every entry a
        future query (from the earliest end drafts in flight can leave) may
        see is held, every entry below ``swa_freed`` is 0."""
        swa = req.swa_pages
        if len(swa) != len(req.pages):
            raise AssertionError(
                f"request {req.rid}: {len(swa)} sliding entries for {len(req.pages)} pages"
            )
        kv_len = req.kv_len - (req.spec.inflight if req.spec is not None else 0)
        visible = freeable_below(kv_len, self.sliding.window, self.page_size)
        if req.swa_freed > visible or swa[: req.swa_freed].count(NULL_PAGE) != req.swa_freed:
            raise AssertionError(
                f"request {req.rid}: sliding entries below {req.swa_freed} held, "
                f"or freed past {visible}"
            )
        if NULL_PAGE in swa[visible:]:
            raise AssertionError(
                f"request {req.rid}: a sliding page a future query sees (from page "
                f"{visible} of {len(swa)}) was freed"
            )
        for p in swa:
            if p:
                swa_holders[p] = swa_holders.get(p, 0) + 1
