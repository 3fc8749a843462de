"""KV-pool metadata: which of the worker's pages are free and who holds the rest.

The scheduler never touches KV tensors; it hands out page ids and the worker
writes the KV of position p of a request at slot p % page_size of page
``table[p // page_size]``.

Ref counts are stored sparsely because sharing is rare: a page that is not on
the free list has one holder (count 1) unless ``share`` raised it, in which
case ``_extra[page]`` holds count - 1. The free list is a stack in a packed
32-bit array (``array('i')``, like every page table of the scheduler) that
never shrinks: the free pages are ``_stack[:_top]``, allocation copies a
slice off the top and release copies pages back over it (memcpy), with no
per-page Python work, which keeps the scheduler's step cheap even at page
size 1. (Deleting from and extending a multi-megabyte array instead
reallocates it on almost every call, remapping its pages, which measurably
slowed unrelated code.) A million free pages are 4 MB the garbage collector
never scans.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from scheduler_service.core.ids import ID_TYPE

PAGE_ID_TYPE = ID_TYPE  # 32-bit page ids


def _descending(num_pages: int) -> array:
    return array(PAGE_ID_TYPE, range(num_pages - 1, -1, -1))


class PagePoolError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Popped from the top; initialised descending so low ids go out first.
        self._stack = _descending(num_pages)
        self._top = num_pages
        self._extra: dict[int, int] = {}

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    @property
    def _free(self) -> array:
        """The free pages (a copy), for checks."""
        return self._stack[: self._top]

    def refcount(self, page: int) -> int:
        """O(free pages) when the page is free; meant for tests and checks."""
        if page in self._extra:
            return self._extra[page] + 1
        return 0 if page in self._free else 1

    # ---------------------------------------------------------- mutations
    def alloc(self, n: int) -> array | None:
        """Take n pages (ref count 1 each, a packed array), or None if fewer
        than n are free."""
        if n <= 0:
            return array(PAGE_ID_TYPE)
        top = self._top
        if n > top:
            return None
        pages = self._stack[top - n : top]
        pages.reverse()
        self._top = top - n
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add one holder to each page (e.g. several sequences reading one prefix)."""
        extra = self._extra
        for p in pages:
            extra[p] = extra.get(p, 0) + 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one holder from each page; pages left without holders become free."""
        if not pages:
            return
        extra = self._extra
        if not extra:
            self._push(pages)
            return
        for p in pages:
            count = extra.get(p)
            if count is None:
                self._push((p,))
            elif count == 1:
                del extra[p]
            else:
                extra[p] = count - 1

    def _push(self, pages: Sequence[int]) -> None:
        if type(pages) is not array or pages.typecode != PAGE_ID_TYPE:  # type: ignore[attr-defined]
            pages = array(PAGE_ID_TYPE, pages)
        stack, top, k = self._stack, self._top, len(pages)
        if top + k <= len(stack):
            stack[top : top + k] = pages  # same length: a copy, no resize
        else:  # more releases than pages (a double free): grow; integrity reports it
            del stack[top:]
            stack.extend(pages)
        self._top = top + k

    def reset(self, num_pages: int | None = None) -> None:
        """Forget every holder (the worker's KV is gone, e.g. after worker loss);
        ``num_pages``: the size of the worker that came back, if it differs."""
        if num_pages is not None:
            if num_pages <= 0:
                raise ValueError(f"need num_pages > 0, got {num_pages}")
            self.num_pages = num_pages
        self._stack = _descending(self.num_pages)
        self._top = self.num_pages
        self._extra.clear()

    # --------------------------------------------------------- invariants
    def check_integrity(self, holders: dict[int, int] | None = None) -> None:
        """Check the free list and ref counts; with ``holders`` (page -> number of
        holders found by walking the cache and the requests), check that every
        page is either free with no holder or held exactly refcount times."""
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            dup = len(free) - len(free_set)
            raise PagePoolError(f"{dup} page(s) are on the free list twice (double free)")
        bad = [p for p in free_set if not 0 <= p < self.num_pages]
        if bad:
            raise PagePoolError(f"free list has ids outside the pool: {bad[:5]}")
        shared_free = free_set.intersection(self._extra)
        if shared_free:
            raise PagePoolError(f"free pages with extra holders: {sorted(shared_free)[:5]}")
        if holders is None:
            return
        for page in range(self.num_pages):
            found = holders.get(page, 0)
            expected = 0 if page in free_set else 1 + self._extra.get(page, 0)
            if found != expected:
                state = "free" if page in free_set else f"ref count {expected}"
                raise PagePoolError(
                    f"page {page} is {state} but {found} holder(s) were found "
                    "(leaked or double-owned page)"
                )
