"""Radix tree from token prefixes to the KV pages that hold them.

Each node owns an edge: ``key`` (tokens, a whole number of pages) and
``pages`` (one page id per ``page_size`` tokens of ``key``), both packed
32-bit arrays (radix_node.py says why). Callers pass keys and page tables
as such arrays (requests keep theirs packed); lists are packed on entry.
Edges are compared as array slices (C comparisons, a binary search over
slices for a partial match), never token by token in Python. A path from a
namespace root spells a cached prefix; its pages, concatenated, are that
prefix's page table. Requests with different ``extra_key`` live under
different roots and never share pages.

Locks: ``lock(node)`` pins a node and all its ancestors (a running request
reads that whole path). Only unlocked leaves can be evicted, least recently
used first, from a heap that is updated as nodes change (entries are
invalidated lazily and the heap is compacted when stale ones pile up).

Page accounting, true after every public call::

    evictable_pages == sum(len(n.pages) for unlocked nodes)
    protected_pages == sum(len(n.pages) for locked nodes)

With a sliding pool (kv/sliding.py) each node also holds its sliding
pages (``swa``, 0 for a tombstone): the cache keeps its own reference on
each, a match is cut back to the longest prefix whose last window's
sliding pages are held, and ``evict_swa`` drops the cached references no
request shares, least recently used nodes (ancestors first) first, without
touching the full pages. Node locks cover the full pages; a request's own
references cover the sliding pages it reads.

Beside it: radix_continuation.py walks what follows a sequence (speculative
drafts), radix_events.py keeps the block hashes and KV events.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable
from typing import Any

from scheduler_service.core.ids import as_id_array, id_array
from scheduler_service.core.kv.events import EventLog
from scheduler_service.core.kv.id_runs import common_len, differing_pages
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_continuation import continuation
from scheduler_service.core.kv.radix_events import (
    check_hashes,
    log_cleared,
    log_removed,
    log_stored,
    log_unusable,
    split_hashes,
)
from scheduler_service.core.kv.radix_node import (
    InsertResult,
    MatchResult,
    RadixCacheError,
    RadixNode,
)
from scheduler_service.core.kv.sliding import (
    NULL_PAGE,
    SlidingPages,
    freeable_below,
    usable_prefix_pages,
)


class RadixCache:
    # Device locks held by the host tier's copies in flight (kv/hiradix_cache.py).
    transfer_locks = 0
    # The file tier (kv/storage_tier.py): only a HiRadixCache may have one.
    storage = None

    def __init__(
        self,
        page_size: int,
        pool: PagePool | None = None,
        enable_events: bool = False,
        max_events: int = 65536,
        *,
        sliding: SlidingPages | None = None,
    ) -> None:
        if pool is not None and pool.page_size != page_size:
            raise ValueError("the cache and its page pool disagree on page_size")
        self.page_size = page_size
        self.pool = pool
        self.sliding = sliding
        self.events: EventLog | None = EventLog(max_events) if enable_events else None
        self._roots: dict[str | None, RadixNode] = {}
        self._root(namespace=None)
        self.evictable_pages = 0
        self.protected_pages = 0
        self._clock = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._heap_seq = 0
        self._num_nodes = 0

    # ------------------------------------------------------------ helpers
    def _root(self, namespace: str | None) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            swa = id_array() if self.sliding is not None else None
            root = RadixNode(id_array(), id_array(), parent=None, namespace=namespace, swa=swa)
            root.lock_ref = 1  # roots are never evicted
            self._roots[namespace] = root
        return root

    def _child_key(self, key: array, pos: int) -> Any:
        if self.page_size == 1:
            return key[pos]
        return key[pos : pos + self.page_size].tobytes()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push(self, node: RadixNode) -> None:
        """Make `node` (an unlocked leaf) an eviction candidate at its access time."""
        self._heap_seq += 1
        node.heap_seq = self._heap_seq
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [e for e in self._heap if e[2].heap_seq == e[1]]
        heapq.heapify(self._heap)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        if node.lock_ref == 0 and not node.children and node.parent is not None:
            self._push(node)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node`'s edge after `at` tokens; return the new upper node."""
        page_size = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % page_size == 0
        upper = RadixNode(node.key[:at], node.pages[: at // page_size], parent, node.namespace)
        if node.swa is not None:
            upper.swa = node.swa[: at // page_size]
            node.swa = node.swa[at // page_size :]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        split_hashes(upper, node, at // page_size)
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.pages = node.pages[at // page_size :]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------- lookup
    def match(
        self,
        key: Iterable[int],
        extra_key: str | None = None,
        limit: int | None = None,
        touch: bool = True,
    ) -> MatchResult:
        """Longest cached page-aligned prefix of key[:limit].

        With ``touch`` (admission), the LRU clock of the path advances and a
        partially matched edge is split so the result node ends exactly at the
        match (ready to lock). Without it (policies), the tree is not changed
        and ``node`` is the deepest node matched in full.
        """
        key = as_id_array(key)
        root = self._roots.get(extra_key)
        n = len(key) if limit is None else min(len(key), limit)
        page_size = self.page_size
        n -= n % page_size
        if root is None or n == 0:
            return MatchResult(id_array(), 0, root or self._roots[None], self._no_swa())
        sliding = self.sliding
        if sliding is not None:
            # Walk without changing the tree, cut back to a reusable length,
            # then walk (and split, with touch) exactly to it.
            probe = self._walk(root, key, n, touch=False)
            n = page_size * usable_prefix_pages(
                probe.swa, len(probe.pages), sliding.window, page_size
            )
            if n == 0:
                return MatchResult(id_array(), 0, root, id_array())
        return self._walk(root, key, n, touch)

    def _no_swa(self) -> array | None:
        return id_array() if self.sliding is not None else None

    def _walk(self, root: RadixNode, key: array, n: int, touch: bool) -> MatchResult:
        """The match of key[:n] (page aligned) under ``root`` (see ``match``)."""
        page_size = self.page_size
        now = self._tick() if touch else 0
        swa = self._no_swa()
        node, pos = root, 0
        pages = id_array()
        while pos < n:
            child = node.children.get(
                key[pos] if page_size == 1 else key[pos : pos + page_size].tobytes()
            )
            if child is None:
                break
            edge = child.key
            m = common_len(key, pos, edge, min(len(edge), n - pos))
            m -= m % page_size
            if m < len(edge):
                if m == 0:
                    break
                if not touch:
                    pages += child.pages[: m // page_size]
                    if swa is not None:
                        swa += child.swa[: m // page_size]
                    pos += m
                    break
                child = self._split(child, m)
            pages += child.pages
            if swa is not None:
                swa += child.swa
            pos += m
            node = child
            if touch:
                self._touch(node, now)
        return MatchResult(pages, pos, node, swa)

    def continuation(
        self,
        key: array,
        extra_key: str | None,
        max_tokens: int,
        start: RadixNode | None = None,
    ) -> array | None:
        """The tokens that follow all of ``key`` in the tree, up to
        ``max_tokens`` (radix_continuation.py); None when nothing does.
        ``start``: a node whose path spells the start of ``key``. Read-only."""
        return continuation(
            self._roots.get(extra_key), self.page_size, key, max_tokens, start=start
        )

    # ------------------------------------------------------------- insert
    def insert(
        self,
        key: Iterable[int],
        pages: Iterable[int],
        extra_key: str | None = None,
        *,
        swa: array | None = None,
    ) -> InsertResult:
        """Cache ``key`` (page aligned) whose KV is in ``pages``.

        The cache takes ownership of the caller's pages for the part of the
        key it did not hold. Where it already held the tokens under other
        pages, those caller pages are returned in ``dup_pages`` (still the
        caller's). ``swa``: the caller's sliding entries (a sliding pool
        only; parallel to ``pages``, 0 where freed): the cache takes its own
        reference on each it stores, keeps the zeros as tombstones, and
        revives its own tombstones where the caller still holds the page.
        """
        key = as_id_array(key)
        pages = as_id_array(pages)
        sliding = self.sliding
        if sliding is not None and (swa is None or len(swa) != len(pages)):
            raise RadixCacheError("a sliding cache needs one sliding entry per page")
        page_size = self.page_size
        n = len(key)
        if n % page_size or len(pages) != n // page_size:
            raise RadixCacheError(
                f"insert needs a page-aligned key with one page per {page_size} tokens "
                f"(got {n} tokens, {len(pages)} pages)"
            )
        node = self._root(extra_key)
        now = self._tick()
        pos = 0
        dup = id_array()
        while pos < n:
            child = node.children.get(
                key[pos] if page_size == 1 else key[pos : pos + page_size].tobytes()
            )
            if child is None:
                # Slices are copies: the leaf never shares the caller's arrays.
                leaf_swa = None
                if sliding is not None:
                    leaf_swa = swa[pos // page_size :]
                    for p in leaf_swa:
                        if p:
                            sliding.tree_take(p)
                leaf = self._add_leaf(node, key[pos:], pages[pos // page_size :], now, swa=leaf_swa)
                return InsertResult(pos, dup, leaf)
            edge = child.key
            m = common_len(key, pos, edge, min(len(edge), n - pos))
            m -= m % page_size
            if m == 0:
                raise RadixCacheError("a child was filed under a key it does not start with")
            if m < len(edge):
                child = self._split(child, m)
            mine = pages[pos // page_size : (pos + m) // page_size]
            if mine != child.pages:
                dup += differing_pages(mine, child.pages)
            if sliding is not None and NULL_PAGE in child.swa:
                self._revive(child, swa[pos // page_size : (pos + m) // page_size])
            pos += m
            node = child
            self._touch(node, now)
        return InsertResult(n, dup, node)

    def _revive(self, node: RadixNode, mine: array) -> None:
        """Where ``node`` has a tombstone and the caller (same tokens, same
        positions, so the same KV) still holds its sliding page, the cache
        takes a reference on the caller's page."""
        raw = mine.tobytes()
        first = (len(raw) - len(raw.lstrip(b"\0"))) // mine.itemsize
        entries, take = node.swa, self.sliding.tree_take
        for j in range(first, len(mine)):
            p = mine[j]
            if p and not entries[j]:
                take(p)
                entries[j] = p

    def _add_leaf(
        self, parent: RadixNode, key: array, pages: array, now: int, *, swa: array | None = None
    ) -> RadixNode:
        """A leaf under ``parent`` owning ``key`` and ``pages`` (copies, never
        a caller's array: requests append to theirs)."""
        leaf = RadixNode(key, pages, parent, parent.namespace, swa=swa)
        leaf.last_access = now
        parent.children[self._child_key(key, 0)] = leaf
        self._num_nodes += 1
        self.evictable_pages += len(pages)
        if self.events is not None:
            log_stored(self.events, parent, leaf, self.page_size, usable=self._usable_pages(leaf))
        self._push(leaf)
        return leaf

    def _usable_pages(self, leaf: RadixNode) -> list[bool] | None:
        """For each page of ``leaf``: whether the prefix ending with it can be
        reused now (a sliding cache only; None: all can)."""
        sliding = self.sliding
        if sliding is None:
            return None
        page_size, window = self.page_size, sliding.window
        before = 0
        node = leaf.parent
        while node is not None and node.parent is not None:
            before += len(node.pages)
            node = node.parent
        # The last tombstone at or before the leaf's start, as an absolute index.
        last_zero = -1
        back = -(-window // page_size) + 1  # entries a window can reach back
        node, end = leaf.parent, before
        while node is not None and node.parent is not None and last_zero < 0 and back > 0:
            entries = node.swa
            for j in range(len(entries) - 1, max(len(entries) - back, 0) - 1, -1):
                if not entries[j]:
                    last_zero = end - len(entries) + j
                    break
            back -= len(entries)
            end -= len(entries)
            node = node.parent
        usable = []
        for j, p in enumerate(leaf.swa):
            k = before + j + 1
            if not p:
                last_zero = k - 1
            usable.append(last_zero < freeable_below(k * page_size, window, page_size))
        return usable

    # -------------------------------------------------------------- locks
    def lock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                n = len(node.pages)
                self.evictable_pages -= n
                self.protected_pages += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RadixCacheError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.pages)
                self.evictable_pages += n
                self.protected_pages -= n
                if not node.children:
                    self._push(node)
            node = node.parent

    # ----------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages (whole leaves, LRU first) if that
        many are evictable; return how many were freed."""
        if self.pool is None:
            raise RadixCacheError("this cache has no page pool to evict into")
        freed = 0
        heap = self._heap
        release = self.pool.release
        events = self.events
        while freed < num_pages and heap:
            _, seq, node = heapq.heappop(heap)
            if node.heap_seq != seq:
                continue
            node.heap_seq = -1
            parent = node.parent
            if node.children or node.lock_ref or parent is None:
                continue
            release(node.pages)
            if node.swa is not None:
                drop = self.sliding.tree_drop
                for p in node.swa:
                    if p:
                        drop(p)
            freed += len(node.pages)
            self.evictable_pages -= len(node.pages)
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._num_nodes -= 1
            if events is not None:
                log_removed(events, node)
            if not parent.children:
                if parent.parent is not None:
                    if parent.lock_ref == 0:
                        self._push(parent)
                elif parent.namespace is not None:
                    del self._roots[parent.namespace]
        return freed

    def evict_swa(self, num_pages: int) -> int:
        """Free at least ``num_pages`` sliding pages, if that many are cached
        and shared with no request, by dropping the cache's references
        (tombstones), least recently used nodes first and ancestors before
        their descendants. Full pages and locks are untouched. Returns how
        many were freed."""
        sliding = self.sliding
        if sliding is None or num_pages <= 0:
            return 0
        nodes: list[tuple[int, int, int, RadixNode]] = []
        for root in self._roots.values():
            stack = [(root, 0)]
            while stack:
                node, depth = stack.pop()
                for child in node.children.values():
                    stack.append((child, depth + 1))
                if node.parent is not None and node.swa.count(NULL_PAGE) != len(node.swa):
                    nodes.append((node.last_access, depth, len(nodes), node))
        nodes.sort()
        freed = 0
        is_tree_only, drop = sliding.is_tree_only, sliding.tree_drop
        for _, _, _, node in nodes:
            entries = node.swa
            first = -1
            for j, p in enumerate(entries):
                if p and is_tree_only(p):
                    drop(p)
                    entries[j] = NULL_PAGE
                    freed += 1
                    if first < 0:
                        first = j
            if first >= 0 and self.events is not None:
                log_unusable(
                    self.events, node, first, window=sliding.window, page_size=self.page_size
                )
            if freed >= num_pages:
                break
        return freed

    def evict_all_unlocked(self) -> int:
        return self.evict(self.evictable_pages)

    def reset(self) -> None:
        """Forget everything (the KV contents are gone, e.g. worker loss).

        The page pool is reset by its owner; locks held by requests are void.
        """
        self._roots.clear()
        self._root(namespace=None)
        self.evictable_pages = 0
        self.protected_pages = 0
        self._heap = []
        self._num_nodes = 0
        if self.events is not None:
            log_cleared(self.events)

    # ------------------------------------------------------------ queries
    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def roots(self) -> list[RadixNode]:
        return list(self._roots.values())

    def take_events(self) -> list:
        return self.events.take() if self.events is not None else []

    # --------------------------------------------------------- invariants
    def check_integrity(
        self,
        holders: dict[int, int] | None = None,
        swa_holders: dict[int, int] | None = None,
    ) -> None:
        """Check structure, lock counts, page accounting and the eviction heap.

        Adds one holder per cached page to ``holders`` (page -> count) so the
        caller can check the page pool against the cache and the requests;
        likewise each cached sliding page to ``swa_holders``.
        """
        page_size = self.page_size
        live_seqs = {seq for _, seq, node in self._heap if node.heap_seq == seq}
        evictable = protected = nodes = 0
        for namespace, root in self._roots.items():
            if root.parent is not None or root.key or root.namespace != namespace:
                raise RadixCacheError(f"malformed root for namespace {namespace!r}")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for ck, child in node.children.items():
                    if child.parent is not node or child.namespace != namespace:
                        raise RadixCacheError(f"{child!r} is not linked to its parent")
                    if not child.key or ck != self._child_key(child.key, 0):
                        raise RadixCacheError(f"{child!r} is filed under the wrong key {ck!r}")
                    child_locks += child.lock_ref
                    stack.append(child)
                if node.parent is None:
                    continue
                nodes += 1
                if len(node.key) % page_size or len(node.pages) != len(node.key) // page_size:
                    raise RadixCacheError(f"{node!r} has {len(node.pages)} pages for its key")
                if node.lock_ref < child_locks:
                    raise RadixCacheError(f"{node!r} holds fewer locks than its children")
                if node.lock_ref:
                    protected += len(node.pages)
                else:
                    evictable += len(node.pages)
                    if not node.children and node.heap_seq not in live_seqs:
                        raise RadixCacheError(f"evictable leaf {node!r} is missing from the heap")
                if self.events is not None:
                    check_hashes(node, page_size)
                if holders is not None:
                    for p in node.pages:
                        holders[p] = holders.get(p, 0) + 1
                if (node.swa is None) != (self.sliding is None) or (
                    node.swa is not None and len(node.swa) != len(node.pages)
                ):
                    raise RadixCacheError(f"{node!r} has no sliding entry per page")
                if swa_holders is not None and node.swa is not None:
                    for p in node.swa:
                        if p:
                            swa_holders[p] = swa_holders.get(p, 0) + 1
        if (evictable, protected) != (self.evictable_pages, self.protected_pages):
            raise RadixCacheError(
                f"page accounting drifted: counted evictable={evictable} protected={protected}, "
                f"recorded evictable={self.evictable_pages} protected={self.protected_pages}"
            )
        if nodes != self._num_nodes:
            raise RadixCacheError(f"node count drifted: {nodes} != {self._num_nodes}")
