"""The radix cache with a host tier (SGLang's HiRadixCache, scheduler side).

The worker keeps a host pool beside its device pool; the scheduler owns
both pools' metadata and decides every copy, which rides on a plan
(kv/host_transfers.py; plan.py says what the worker guarantees). A node's
KV is on the device (``pages``), on the host (``host``) or both, never
neither (radix_node.py):

- *device residency is prefix-closed*: a node on the device has its whole
  path on the device, so a host-only node has host-only descendants only.
  Requests lock device nodes only; the device evicts unlocked nodes with no
  child on the device (LRU, the base heap).
- *device eviction*: a node with a host copy loses its device pages and
  stays, host-only. One without: under ``write_back`` it is written back
  first (a write-back on the plan being built; its device pages may be
  reused by that plan's loads and forward, which the worker runs after the
  write-backs); otherwise, or when the host pool has no room, it is dropped
  with its (host-only) subtree.
- *write policies* (SGLang's names): ``write_through`` copies a node to the
  host when it enters the cache (its first hit), ``write_through_selective``
  once matches and inserts reached it ``hits_to_write`` times (SGLang: 2),
  ``write_back`` only as the device evicts it. A node due for a copy is
  queued and copied at the start of the next plan (``plan_writes``): a node
  enters the cache when the plan computing it is built, so a copy on that
  same plan would read the device page before the forward fills it.
- *host eviction* drops host-only leaves with no copy in flight, least
  recently used first (a heap of their own, kept current like the device
  one). A node with both copies keeps its host copy (SGLang's rule: it is
  what the device will evict next, and the copy saves it then).
- *load back*: a match reports its device part and the host-only part past
  it (``MatchResult.host_len``); admission budgets the pages a load takes
  like any other and calls ``load_back``, which gives the host-only nodes
  device pages and plans their copies on the plan being built (the step's
  forward reads them). All or nothing, and not below
  ``load_back_threshold`` tokens (SGLang's 10): shorter hits are computed.
- *a node under a copy* is held until the plan carrying it is answered
  (``answered``): its host copy stays (``host_ref``: host eviction passes
  it by), and a load's last node is locked on the device. A write-through's
  node is not (``plan_writes`` says why).
- *insert* over a host-only node takes the caller's pages as its device copy
  (the caller computed the same tokens), as SGLang's does; over an unlocked
  device node holding other pages it takes the caller's and frees its own
  (``_swap``), so no request pins a duplicate of an unlocked node.
- *worker loss*: the host pool is the worker's, so ``reset`` drops both
  tiers, every copy in flight and the host pool's holders.

The host side (host heap, host eviction, copies, load back, answers) is in
host_tier.py, the copies' records in host_transfers.py, the invariants in
hicache_integrity.py; the file tier behind the host (``storage``, None
without one) in storage_tier.py and storage_ops.py.

KV events name the medium (kv/events.py): a device eviction that keeps the
host copy withdraws the blocks from the device only; a copy to the host
stores them on the host when planned (as device stores are: the worker runs
plans in order); a load or an insert over a host-only node stores them on
the device again; host eviction withdraws them from the host.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable

from scheduler_service.core.ids import as_id_array, id_array
from scheduler_service.core.kv.events import Medium
from scheduler_service.core.kv.hicache_integrity import check_tiers
from scheduler_service.core.kv.host_tier import HostTierOps
from scheduler_service.core.kv.host_transfers import HostTransfers
from scheduler_service.core.kv.id_runs import common_len, differing_pages
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.kv.radix_events import log_node_stored, log_removed, split_hashes
from scheduler_service.core.kv.radix_node import (
    InsertResult,
    MatchResult,
    RadixCacheError,
    RadixNode,
)
from scheduler_service.core.kv.storage_ops import host_pages_dropped
from scheduler_service.core.kv.storage_tier import StorageTier


class HiRadixCache(HostTierOps, RadixCache):
    def __init__(
        self,
        page_size: int,
        pool: PagePool,
        host_pool: PagePool,
        *,
        hits_to_write: int | None,
        load_back_threshold: int = 10,
        enable_events: bool = False,
        max_events: int = 65536,
        storage: StorageTier | None = None,
    ) -> None:
        """``hits_to_write``: hits after which a node is copied to the host
        (1: write_through; None: write_back, copied only when evicted);
        ``storage``: the file tier behind the host (None: none)."""
        if host_pool.page_size != page_size:
            raise ValueError("the host pool and the cache disagree on page_size")
        super().__init__(page_size, pool, enable_events, max_events)
        self.host_pool = host_pool
        self.hits_to_write = hits_to_write
        self.load_back_threshold = load_back_threshold
        self.transfers = HostTransfers()
        self._host_heap: list[tuple[int, int, RadixNode]] = []
        self._host_heap_seq = 0
        self._to_write: list[RadixNode] = []  # due for a write-through
        self._flushing = False
        self.storage = storage

    # ------------------------------------------------------------ leaves
    @staticmethod
    def is_device_leaf(node: RadixNode) -> bool:
        """Evictable from the device: on it, unlocked, no child on it."""
        if node.pages is None or node.lock_ref or node.parent is None:
            return False
        return all(child.pages is None for child in node.children.values())

    def _refresh(self, node: RadixNode) -> None:
        """Put ``node`` in whichever LRU heap it now belongs to."""
        if self.is_device_leaf(node):
            self._push(node)
        elif self.is_host_leaf(node):
            self._host_push(node)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        self._refresh(node)

    def _hit(self, node: RadixNode) -> None:
        """A match or an insert reached ``node``: queue its write-through
        once it has been hit often enough (never under write_back)."""
        need = self.hits_to_write
        if need is None:
            return
        node.hit_count += 1
        if node.host is None and node.pages is not None and node.hit_count >= need:
            self._to_write.append(node)

    # ------------------------------------------------------------- split
    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node``'s edge after ``at`` tokens (both tiers' pages)."""
        page_size = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % page_size == 0
        k = at // page_size
        pages, host = node.pages, node.host
        upper = RadixNode(
            node.key[:at], pages[:k] if pages is not None else None, parent, node.namespace
        )
        if pages is not None:
            node.pages = pages[k:]
        if host is not None:
            upper.host = host[:k]
            node.host = host[k:]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        if node.host_ref:
            self.transfers.on_split(upper, node)
        split_hashes(upper, node, k)
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------- match
    def match(
        self,
        key: Iterable[int],
        extra_key: str | None = None,
        limit: int | None = None,
        touch: bool = True,
    ) -> MatchResult:
        """As RadixCache.match; ``pages``, ``length`` and ``node`` are the
        match's device part, ``host_len`` and ``host_node`` the host-only
        part past it (what a load would bring back)."""
        key = as_id_array(key)
        root = self._roots.get(extra_key)
        page_size = self.page_size
        n = len(key) if limit is None else min(len(key), limit)
        n -= n % page_size
        if root is None or n == 0:
            base = root or self._roots[None]
            return MatchResult(id_array(), 0, base, host_node=base)
        now = self._tick() if touch else 0
        node, pos = root, 0
        pages = id_array()
        device_len, device_node = 0, root
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
                if not touch:  # the tree unchanged: ``node`` stays the last full match
                    if child.pages is not None:
                        pages += child.pages[: m // page_size]
                        device_len = pos + m
                    pos += m
                    break
                child = self._split(child, m)
            pos += m
            node = child
            if child.pages is not None:
                pages += child.pages
                device_len, device_node = pos, child
            if touch:
                self._touch(child, now)
                self._hit(child)
        return MatchResult(
            pages, device_len, device_node, host_len=pos - device_len, host_node=node
        )

    # ------------------------------------------------------------ insert
    def insert(
        self,
        key: Iterable[int],
        pages: Iterable[int],
        extra_key: str | None = None,
        *,
        swa: array | None = None,
    ) -> InsertResult:
        """As RadixCache.insert; where a node is host-only the caller's pages
        become its device copy (they hold the same tokens' KV); where an
        unlocked node holds other pages, they are swapped for the caller's
        (``_swap``): ``dup_pages`` names only duplicates of locked nodes.
        ``prefix_len`` ends where the cache first took a page of the caller's
        for a node it held (the caller must not keep those as its own)."""
        if swa is not None:
            raise RadixCacheError("the host tier does not serve sliding-window models")
        key = as_id_array(key)
        pages = as_id_array(pages)
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
        before = -1  # where the caller's pages started being taken, if they were
        dup = id_array()
        while pos < n:
            child = node.children.get(
                key[pos] if page_size == 1 else key[pos : pos + page_size].tobytes()
            )
            if child is None:
                leaf = self._add_leaf(node, key[pos:], pages[pos // page_size :], now)
                self._hit(leaf)
                return InsertResult(pos if before < 0 else before, dup, leaf)
            edge = child.key
            m = common_len(key, pos, edge, min(len(edge), n - pos))
            m -= m % page_size
            if m == 0:
                raise RadixCacheError("a child was filed under a key it does not start with")
            if m < len(edge):
                child = self._split(child, m)
            mine = pages[pos // page_size : (pos + m) // page_size]
            if child.pages is None:
                if before < 0:
                    before = pos
                self._adopt(child, mine)
            else:
                if mine != child.pages:
                    if child.lock_ref:
                        dup += differing_pages(mine, child.pages)
                    else:
                        if before < 0:
                            before = pos
                        self._swap(child, mine)
                self._hit(child)
            pos += m
            node = child
            self._touch(node, now)
        return InsertResult(n if before < 0 else before, dup, node)

    def _adopt(self, node: RadixNode, pages: array) -> None:
        """Host-only ``node`` (its parent on the device) takes ``pages``."""
        if node.lock_ref:
            raise RadixCacheError(f"host-only {node!r} is locked")
        node.pages = pages
        self.evictable_pages += len(pages)
        if self.events is not None:
            log_node_stored(self.events, node, self.page_size, Medium.DEVICE)

    def _swap(self, node: RadixNode, pages: array) -> None:
        """Unlocked ``node`` takes the caller's copies of its tokens' KV and
        frees its own, so the caller holds no duplicate. Nobody reads the
        node's pages (no lock), and a plan already sent that did reads them
        before any later plan writes the freed pages. Without it a request
        whose chunk the cache meanwhile got elsewhere (a host hit another
        request loaded while it computed) pinned both copies: alone in a
        small pool, it could not continue and was aborted out of memory."""
        self.pool.release(differing_pages(node.pages, pages))
        node.pages = pages

    # ----------------------------------------------------- device eviction
    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RadixCacheError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.pages)
                self.evictable_pages += n
                self.protected_pages -= n
                if self.is_device_leaf(node):
                    self._push(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages (whole device leaves, LRU
        first) if that many are evictable; return how many were freed."""
        freed = 0
        heap = self._heap
        while freed < num_pages and heap:
            _, seq, node = heapq.heappop(heap)
            if node.heap_seq != seq:
                continue
            node.heap_seq = -1
            if self.is_device_leaf(node):
                freed += self._evict_device(node)
        return freed

    def _evict_device(self, node: RadixNode) -> int:
        pages = node.pages
        n = len(pages)
        if node.host is None and self.hits_to_write is None and not self._flushing:
            self._copy_to_host(node)  # write_back: before its pages are freed
        self.pool.release(pages)
        self.evictable_pages -= n
        parent = node.parent
        if node.host is not None:
            node.pages = None
            if self.events is not None:
                log_removed(self.events, node, Medium.DEVICE)
            self._refresh(node)
        else:
            self._drop(node)
        self._refresh(parent)
        return n

    def _drop(self, node: RadixNode) -> None:
        """Remove ``node`` (its device pages already given back) and its
        subtree, which is host-only, from the tree."""
        parent = node.parent
        stack = [node]
        while stack:
            x = stack.pop()
            stack += x.children.values()
            if x.host is not None:
                self.host_pool.release(x.host)
                if self.storage is not None:  # no backup of a page about to be reused
                    host_pages_dropped(self, x.host)
                if self.events is not None:
                    log_removed(self.events, x, Medium.HOST)
            if x is node and self.events is not None:
                log_removed(self.events, x, Medium.DEVICE)
            x.parent = None
            self._num_nodes -= 1
        del parent.children[self._child_key(node.key, 0)]
        self._forget_empty_root(parent)

    def _forget_empty_root(self, parent: RadixNode) -> None:
        if not parent.children and parent.parent is None and parent.namespace is not None:
            del self._roots[parent.namespace]

    # ------------------------------------------------------ whole cache
    def evict_all_unlocked(self) -> int:
        """Drop every unlocked device page and every host-only leaf with no
        copy in flight, writing nothing back (a flush)."""
        self._flushing = True
        try:
            freed = self.evict(self.evictable_pages)
        finally:
            self._flushing = False
        self.evict_host(self.host_pool.num_used)
        return freed

    def reset(self) -> None:
        """Forget both tiers (the worker, whose host pool it was, is gone)."""
        super().reset()
        self.host_pool.reset()
        self.transfers.clear()
        if self.storage is not None:
            self.storage.reset()
        self._host_heap = []
        self._to_write = []

    def check_integrity(
        self,
        holders: dict[int, int] | None = None,
        swa_holders: dict[int, int] | None = None,
    ) -> None:
        """Both tiers' invariants (hicache_integrity.py); each cached device
        page is added to ``holders``. No sliding pages here."""
        check_tiers(self, holders)
