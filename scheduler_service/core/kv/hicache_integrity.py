"""The invariants of the radix cache with a host tier (kv/hiradix_cache.py),
checked over both tiers (the scheduler's ``check_integrity`` runs them after
every step and update in tests):

- the tree's shape, as RadixCache's: links, keys filed under their first
  page, a node's lock count at least its children's, block hashes;
- every node holds its KV somewhere: device pages, host pages, or both, one
  page per ``page_size`` tokens of each; device residency is prefix-closed
  (a host-only node has no child on the device) and only device nodes are
  locked;
- device pages: the evictable and protected counts match a recount, every
  unlocked device leaf has a live entry in the device heap, and each
  cached device page is reported in ``holders`` (the scheduler checks the
  device pool against them and the requests);
- host pages: each host page is free or held by exactly one node or one
  file-tier prefetch not yet reported (copies in flight fill or read pages
  their nodes hold; a planned file write reads a page a node holds),
  checked against the host pool;
- copies in flight: every node's ``host_ref`` is what the records of the
  plans in flight (and the one being built) account for; every host-only
  leaf with none has a live entry in the host heap.
"""

from __future__ import annotations

from typing import Any

from scheduler_service.core.kv.radix_events import check_hashes
from scheduler_service.core.kv.radix_node import RadixCacheError, RadixNode


def check_tiers(cache: Any, holders: dict[int, int] | None = None) -> None:
    """Check ``cache`` (a HiRadixCache, which calls this: typed loosely so
    the two modules need not import each other)."""
    page_size = cache.page_size
    live = {seq for _, seq, node in cache._heap if node.heap_seq == seq}
    host_live = {seq for _, seq, node in cache._host_heap if node.host_heap_seq == seq}
    refs, _ = cache.transfers.held()
    cache.transfers.check_pairs()
    host_holders: dict[int, int] = {}
    evictable = protected = nodes = 0
    for namespace, root in cache._roots.items():
        if root.parent is not None or root.key or root.namespace != namespace:
            raise RadixCacheError(f"malformed root for namespace {namespace!r}")
        stack: list[RadixNode] = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                if child.parent is not node or child.namespace != namespace:
                    raise RadixCacheError(f"{child!r} is not linked to its parent")
                if not child.key or ck != cache._child_key(child.key, 0):
                    raise RadixCacheError(f"{child!r} is filed under the wrong key {ck!r}")
                if node.parent is not None and node.pages is None and child.pages is not None:
                    raise RadixCacheError(f"{child!r} is on the device below host-only {node!r}")
                child_locks += child.lock_ref
                stack.append(child)
            if node.parent is None:
                continue
            nodes += 1
            _check_node(cache, node, child_locks, page_size)
            if node.pages is not None:
                if node.lock_ref:
                    protected += len(node.pages)
                else:
                    evictable += len(node.pages)
                    if cache.is_device_leaf(node) and node.heap_seq not in live:
                        raise RadixCacheError(f"device leaf {node!r} is missing from the heap")
                if holders is not None:
                    for p in node.pages:
                        holders[p] = holders.get(p, 0) + 1
            if node.host is not None:
                for p in node.host:
                    host_holders[p] = host_holders.get(p, 0) + 1
            if node.host_ref != refs.get(id(node), 0):
                raise RadixCacheError(
                    f"{node!r} is held by {node.host_ref} host copies, the plans account "
                    f"for {refs.get(id(node), 0)}"
                )
            if cache.is_host_leaf(node) and node.host_heap_seq not in host_live:
                raise RadixCacheError(f"host leaf {node!r} is missing from the host heap")
    if (evictable, protected) != (cache.evictable_pages, cache.protected_pages):
        raise RadixCacheError(
            f"page accounting drifted: counted evictable={evictable} protected={protected}, "
            f"recorded evictable={cache.evictable_pages} protected={cache.protected_pages}"
        )
    if nodes != cache.num_nodes:
        raise RadixCacheError(f"node count drifted: {nodes} != {cache.num_nodes}")
    if cache.storage is not None:  # host pages filled by reads not reported yet
        cache.storage.check(host_holders)
    cache.host_pool.check_integrity(host_holders)


def _check_node(cache: Any, node: RadixNode, child_locks: int, page_size: int) -> None:
    n_pages = len(node.key) // page_size
    if len(node.key) % page_size:
        raise RadixCacheError(f"{node!r} has a key that is not page aligned")
    if node.pages is None and node.host is None:
        raise RadixCacheError(f"{node!r} holds its KV nowhere")
    if node.pages is not None and len(node.pages) != n_pages:
        raise RadixCacheError(f"{node!r} has {len(node.pages)} device pages for its key")
    if node.host is not None and len(node.host) != n_pages:
        raise RadixCacheError(f"{node!r} has {len(node.host)} host pages for its key")
    if node.pages is None and node.lock_ref:
        raise RadixCacheError(f"host-only {node!r} is locked")
    if node.lock_ref < child_locks:
        raise RadixCacheError(f"{node!r} holds fewer locks than its children")
    if node.swa is not None:
        raise RadixCacheError(f"{node!r} has sliding pages in a host-tier cache")
    if cache.events is not None:
        check_hashes(node, page_size)
