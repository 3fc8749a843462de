"""The host side of HiRadixCache (kv/hiradix_cache.py): the host-only
leaves' LRU heap and host eviction, copies to the host (write-through and
write-back), load back, and giving back what a plan's copies held once it
is answered; the file tier's entry points (backup after a copy to the
host, prefetch holds and reports, the plan's copies: kv/storage_ops.py).
A mixin: HiRadixCache owns the tree, the pools and the transfer records
these methods use (hiradix_cache.py describes the tier).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable
from typing import Any

from scheduler_service.core.ids import StorageReadsDone, id_array
from scheduler_service.core.kv.events import Medium
from scheduler_service.core.kv.radix_events import log_node_stored, log_removed
from scheduler_service.core.kv.radix_node import RadixCacheError, RadixNode
from scheduler_service.core.kv.storage_ops import apply_reports, hold_for_prefetch, plan_backup


class HostTierOps:
    @staticmethod
    def is_host_leaf(node: RadixNode) -> bool:
        """Evictable from the host: host-only, no copy in flight, childless."""
        return (
            node.pages is None
            and node.host_ref == 0
            and not node.children
            and node.parent is not None
        )

    def _host_push(self, node: RadixNode) -> None:
        self._host_heap_seq += 1
        node.host_heap_seq = self._host_heap_seq
        heapq.heappush(self._host_heap, (node.last_access, self._host_heap_seq, node))
        if len(self._host_heap) > 2 * self._num_nodes + 1024:
            self._host_heap = [e for e in self._host_heap if e[2].host_heap_seq == e[1]]
            heapq.heapify(self._host_heap)

    # ------------------------------------------------------------- host
    def _host_alloc(self, n: int) -> array | None:
        """``n`` host pages, evicting host-only leaves if short; None if the
        host pool cannot give them."""
        pool = self.host_pool
        if n > pool.num_pages:
            return None
        short = n - pool.num_free
        if short > 0:
            self.evict_host(short)
        return pool.alloc(n)

    def _copy_to_host(self, node: RadixNode) -> bool:
        """Plan ``node``'s device pages' copy to new host pages."""
        host = self._host_alloc(len(node.pages))
        if host is None:
            return False
        node.host = host
        self.transfers.write_back(node, node.pages, host)
        if self.events is not None:
            log_node_stored(self.events, node, self.page_size, Medium.HOST)
        if self.storage is not None:  # and on to the files, after that copy
            plan_backup(self, node)
        return True

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages (host-only leaves, LRU first)
        if that many are evictable; return how many were freed."""
        freed = 0
        heap = self._host_heap
        while freed < num_pages and heap:
            _, seq, node = heapq.heappop(heap)
            if node.host_heap_seq != seq:
                continue
            node.host_heap_seq = -1
            if not self.is_host_leaf(node):
                continue
            parent = node.parent
            freed += len(node.host)
            self.host_pool.release(node.host)
            if self.events is not None:
                log_removed(self.events, node, Medium.HOST)
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._num_nodes -= 1
            self._forget_empty_root(parent)
            self._refresh(parent)
        return freed

    def plan_writes(self) -> None:
        """Copy the nodes due for a write-through to the host, on the plan
        about to be built. Called before anything of that plan enters the
        cache, so every page copied was computed by an earlier plan.

        The node keeps its host copy until that plan is answered; it is not
        locked on the device, as SGLang's is while its copy runs unordered
        with later batches: the worker reads a plan's write-backs before
        that plan or a later one writes any page, so the device may evict
        the node at once. (A device lock taken while the plan is being built
        also took pages that plan's decodes counted on: it aborted requests
        out of memory.)"""
        due, self._to_write = self._to_write, []
        for node in due:
            if node.parent is None or node.pages is None or node.host is not None:
                continue  # dropped, evicted or copied since it was queued
            self._copy_to_host(node)

    # --------------------------------------------------------- load back
    def load_back(self, host_node: RadixNode, device_node: RadixNode) -> array | None:
        """Give the host-only path from ``device_node`` (exclusive, on the
        device and locked by the caller) down to ``host_node`` device pages,
        loaded from the host on the plan being built; the new pages, or None
        (nothing changed) if the device pool cannot give them. ``host_node``
        is then locked until that plan is answered."""
        chain: list[RadixNode] = []
        x = host_node
        while x is not device_node:
            if x.pages is not None or x.parent is None:
                raise RadixCacheError(f"{x!r} on a load path is not host-only")
            chain.append(x)
            x = x.parent
        chain.reverse()
        host = id_array()
        for x in chain:
            host += x.host
            x.host_ref += 1  # kept through the eviction below
        device = self._alloc_device(len(host))
        for x in chain:
            x.host_ref -= 1
        if device is None:
            for x in chain:
                self._refresh(x)  # eviction may have popped its host-heap entry
            return None
        self.transfers.load(chain, host, device)
        at = 0
        for x in chain:
            k = len(x.host)
            x.pages = device[at : at + k]
            at += k
            self.evictable_pages += k
            if self.events is not None:
                log_node_stored(self.events, x, self.page_size, Medium.DEVICE)
        self.lock(host_node)
        self.transfers.hold_lock(host_node)
        return device

    def _alloc_device(self, n: int) -> array | None:
        short = n - self.pool.num_free
        if short > 0:
            if short > self.evictable_pages:
                return None
            self.evict(short)
        return self.pool.alloc(n)

    def answered(self, step_id: int, storage_done: list[StorageReadsDone] | None = None) -> None:
        """Plan ``step_id`` was answered: its copies are done; give back what
        they held. ``storage_done``: the file-tier reads its result reports."""
        if storage_done:
            apply_reports(self, storage_done)
        rec = self.transfers.answered(step_id)
        if rec is None:
            return
        for node in rec.locks:
            if node.parent is not None:
                self.unlock(node)
        for node in rec.host_refs:
            if node.parent is not None:
                node.host_ref -= 1
                if node.host_ref == 0:
                    self._refresh(node)

    @property
    def transfer_locks(self) -> int:
        return self.transfers.held()[1]

    # ------------------------------------------------------ plan and files
    def take_copies(self, plan: Any) -> None:
        """Put the copies planned since the last plan on ``plan`` (a
        StepPlan being finished)."""
        plan.write_backs, plan.loads = self.transfers.take(plan.step_id)
        if self.storage is not None:
            plan.storage_writes, plan.storage_reads = self.storage.take(plan.step_id)

    def wants_plan(self, inflight: bool) -> bool:
        """Whether an otherwise empty step must send a plan: copies are
        planned, or file-tier reads are out and no plan is (a poll)."""
        if self.transfers.pending:
            return True
        storage = self.storage
        return storage is not None and (storage.pending or (storage.outstanding and not inflight))

    @property
    def reads_outstanding(self) -> bool:
        """File-tier reads planned or sent and not reported."""
        storage = self.storage
        return storage is not None and (storage.outstanding or storage.pending)

    def storage_hold(self, req: Any) -> bool:
        """Whether admission passes ``req`` over for its prefetch
        (storage_ops.hold_for_prefetch); False without a file tier."""
        return self.storage is not None and hold_for_prefetch(self, req)

    def note_stored_blocks(self, hashes: Iterable[int]) -> None:
        """The worker's file tier holds these blocks (its report at session
        open); ignored without a file tier."""
        if self.storage is not None:
            self.storage.index.seed(hashes)
