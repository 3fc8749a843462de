"""The sliding pool: KV pages of a model's sliding-window layers.

A model whose worker reports ``num_swa_pages > 0`` has two page pools: the
full pool (full-attention layers, kv/page_pool.py as for every model) and
this one. A request's sliding table is parallel to its full table (one
entry per page) but keeps only what a future query can still see: the next
query sits at position ``kv_len`` and sees keys at positions
``>= kv_len - window + 1`` (transformers' rule: key k is visible to query q
iff q - window < k <= q), so entry i is freed, and set to 0, once
``(i + 1) * page_size <= kv_len - window + 1`` (``freeable_below``).

Page 0 is the null page: never handed out (held for good by the pool
itself), it stands for "no page" in tables and on the wire, and the
worker's sliding page 0 is scratch.

Holding is by reference count, not by lock: every nonzero entry of a
request's sliding table is one reference the request holds, and every
nonzero entry of a radix node's sliding list is one reference the cache
holds (the cache takes its own when it stores a request's pages; the
request keeps its). A cached sliding page is therefore evictable exactly
when the cache is its only holder; ``SlidingPages`` counts those
(``tree_only``) as references change, so budgets never walk the tree.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from scheduler_service.core.kv.page_pool import PagePool

NULL_PAGE = 0


def freeable_below(kv_len: int, window: int, page_size: int) -> int:
    """Entries [0, this) of a sliding table are invisible to every query at
    positions >= ``kv_len``."""
    first_visible = kv_len - window + 1
    return first_visible // page_size if first_visible > 0 else 0


def usable_prefix_pages(swa: array, n_pages: int, window: int, page_size: int) -> int:
    """The longest k <= n_pages such that a prefix of k pages can be reused:
    the sliding entries covering its last ``window - 1`` positions (those the
    next query sees), [freeable_below(k * page_size) , k), are all held (0:
    none held, always usable). ``swa``: the prefix's sliding entries."""
    k = n_pages
    while k > 0:
        lo = freeable_below(k * page_size, window, page_size)
        part = swa[lo:k]
        if NULL_PAGE not in part:
            return k
        # The last tombstone z in [lo, k): every k' in (z, k) still sees it
        # (lo grows with k'), so the next candidate is k' = z.
        k = lo + len(part) - 1 - part[::-1].index(NULL_PAGE)
    return 0


class SlidingPages:
    """The sliding pool and who holds its pages (the requests and the cache)."""

    def __init__(self, num_pages: int, page_size: int, window: int) -> None:
        if num_pages < 2 or window <= 0:
            raise ValueError(f"a sliding pool needs >= 2 pages and a window, got {num_pages}")
        self.window = window
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size)
        self._in_tree = bytearray(num_pages)
        self.tree_only = 0  # cached pages no request holds: evictable
        self.tree_held = 0  # cached pages in all
        self._reserve_null()

    def _reserve_null(self) -> None:
        null = self.pool.alloc(1)
        assert null is not None and null[0] == NULL_PAGE

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def reset(self, num_pages: int | None = None) -> None:
        self.pool.reset(num_pages)
        self._in_tree = bytearray(self.pool.num_pages)
        self.tree_only = self.tree_held = 0
        self._reserve_null()

    # ------------------------------------------------------- request side
    def alloc(self, n: int) -> array | None:
        return self.pool.alloc(n)

    def share(self, pages: Sequence[int]) -> None:
        """A request takes a reference on each nonzero page (cached ones)."""
        extra, in_tree = self.pool._extra, self._in_tree
        for p in pages:
            if p:
                if in_tree[p] and p not in extra:
                    self.tree_only -= 1
                extra[p] = extra.get(p, 0) + 1

    def release(self, pages: Sequence[int]) -> None:
        """A request drops its reference on each nonzero page."""
        extra, in_tree = self.pool._extra, self._in_tree
        push = self.pool.release
        for p in pages:
            if not p:
                continue
            count = extra.get(p)
            if count is None:
                push((p,))
            else:
                if count == 1:
                    del extra[p]
                    if in_tree[p]:
                        self.tree_only += 1
                else:
                    extra[p] = count - 1

    # --------------------------------------------------------- cache side
    def tree_take(self, page: int) -> None:
        """The cache takes its own reference on a request's page."""
        if self._in_tree[page]:
            raise RuntimeError(f"sliding page {page} is cached twice")
        self._in_tree[page] = 1
        self.tree_held += 1
        extra = self.pool._extra
        extra[page] = extra.get(page, 0) + 1

    def tree_drop(self, page: int) -> bool:
        """The cache drops its reference; True if that freed the page."""
        self._in_tree[page] = 0
        self.tree_held -= 1
        extra = self.pool._extra
        count = extra.get(page)
        if count is None:
            self.tree_only -= 1
            self.pool.release((page,))
            return True
        if count == 1:
            del extra[page]
        else:
            extra[page] = count - 1
        return False

    def available_after_release(self, tables: Sequence[Sequence[int]]) -> int:
        """How many sliding pages would become free or evictable if these
        requests' tables were released (pages other requests share do not)."""
        counts: dict[int, int] = {}
        for table in tables:
            for p in table:
                if p:
                    counts[p] = counts.get(p, 0) + 1
        extra, in_tree = self.pool._extra, self._in_tree
        gained = 0
        for p, n in counts.items():
            left = 1 + extra.get(p, 0) - n  # holders left afterwards
            if left == 0 or (left == 1 and in_tree[p]):
                gained += 1
        return gained

    def is_tree_only(self, page: int) -> bool:
        return bool(self._in_tree[page]) and page not in self.pool._extra

    # --------------------------------------------------------- invariants
    def check_integrity(self, holders: dict[int, int], tree_pages: dict[int, int]) -> None:
        """``holders``: page -> references found on requests and cache nodes;
        ``tree_pages``: page -> references found on cache nodes alone."""
        if holders.get(NULL_PAGE):
            raise AssertionError("the null sliding page is held by a request or the cache")
        bad = [p for p, n in tree_pages.items() if n != 1]
        if bad:
            raise AssertionError(f"sliding pages cached by two nodes: {bad[:5]}")
        marked = {p for p in range(self.pool.num_pages) if self._in_tree[p]}
        if marked != set(tree_pages):
            raise AssertionError(
                f"cache markers disagree with the tree: {sorted(marked ^ set(tree_pages))[:5]}"
            )
        only = sum(1 for p in tree_pages if holders.get(p, 0) == 1)
        if (only, len(tree_pages)) != (self.tree_only, self.tree_held):
            raise AssertionError(
                f"sliding cache accounting drifted: counted {only} evictable of "
                f"{len(tree_pages)}, recorded {self.tree_only} of {self.tree_held}"
            )
        counted = dict(holders)
        counted[NULL_PAGE] = 1  # the pool's own hold
        self.pool.check_integrity(counted)
