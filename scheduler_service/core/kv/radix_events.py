"""The radix cache's KV-event bookkeeping (kv_events.py has the events).

With events on, every cached node carries one chained block hash per page
(``RadixNode.hashes``): a new leaf's pages are hashed from its parent's last
hash (or its namespace's seed) and logged as stored, a split divides the
hashes with the pages, an evicted leaf's hashes are logged as removed, and a
reset logs that everything is gone.

With the host tier (kv/hiradix_cache.py) events name their medium: a node
that keeps its blocks but moves between media is announced again for the
medium it enters (``log_node_stored``) and withdrawn from the one it leaves
(``log_removed`` with that medium).

With a sliding pool a prefix is announced only while it can be reused (its
last window's sliding pages held): a new leaf's pages are logged in runs of
usable prefixes, and when sliding eviction makes prefixes unusable their
blocks are logged as removed (the cache may still hold their full pages).
"""

from __future__ import annotations

from array import array

from scheduler_service.core.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    Medium,
    chain_page_hashes,
    namespace_seed,
)
from scheduler_service.core.kv.radix_node import HASH_TYPE, RadixCacheError, RadixNode


def log_stored(
    events: EventLog,
    parent: RadixNode,
    leaf: RadixNode,
    page_size: int,
    *,
    usable: list[bool] | None = None,
) -> None:
    """Hash the pages of ``leaf`` (just added under ``parent``) and log them;
    ``usable``: per page, whether the prefix ending there may be announced
    (None: all)."""
    parent_hash = parent.hashes[-1] if parent.hashes else None
    seed = parent_hash if parent_hash is not None else namespace_seed(parent.namespace)
    hashes = chain_page_hashes(seed, leaf.key, page_size)
    leaf.hashes = array(HASH_TYPE, hashes)
    if usable is None:
        events.append(
            BlockStored(hashes, parent_hash, leaf.key.tolist(), page_size, parent.namespace)
        )
        return
    j, n = 0, len(hashes)
    while j < n:
        if not usable[j]:
            j += 1
            continue
        end = j
        while end < n and usable[end]:
            end += 1
        before = hashes[j - 1] if j else parent_hash
        tokens = leaf.key[j * page_size : end * page_size].tolist()
        events.append(BlockStored(hashes[j:end], before, tokens, page_size, parent.namespace))
        j = end


def log_unusable(
    events: EventLog, node: RadixNode, first: int, *, window: int, page_size: int
) -> None:
    """``node``'s sliding entry ``first`` (and maybe later ones) became a
    tombstone: every prefix ending from that page on, up to a window further
    (in its descendants too), can no longer be reused."""
    removed: list[int] = []
    if node.hashes:
        removed += node.hashes[first:].tolist()
    reach = window - 1  # tokens past the node's end whose window still sees it
    stack = [(child, reach) for child in node.children.values()]
    while stack:
        child, left = stack.pop()
        if left <= 0:
            continue
        if child.hashes:
            removed += child.hashes[: -(-left // page_size)].tolist()
        stack += [(c, left - len(child.key)) for c in child.children.values()]
    if removed:
        events.append(BlockRemoved(removed))


def split_hashes(upper: RadixNode, node: RadixNode, pages: int) -> None:
    """``upper`` took the first ``pages`` pages of ``node``: their hashes too."""
    if node.hashes is not None:
        upper.hashes = node.hashes[:pages]
        node.hashes = node.hashes[pages:]


def log_removed(events: EventLog, node: RadixNode, medium: Medium = Medium.DEVICE) -> None:
    """``node`` was evicted: its pages leave the cache (or ``medium``)."""
    if node.hashes:
        events.append(BlockRemoved(node.hashes.tolist(), medium))


def log_node_stored(events: EventLog, node: RadixNode, page_size: int, medium: Medium) -> None:
    """``node`` (already hashed) now also holds its blocks on ``medium``."""
    if not node.hashes:
        return
    parent = node.parent
    parent_hash = parent.hashes[-1] if parent is not None and parent.hashes else None
    events.append(
        BlockStored(
            node.hashes.tolist(),
            parent_hash,
            node.key.tolist(),
            page_size,
            node.namespace,
            medium,
        )
    )


def log_cleared(events: EventLog) -> None:
    events.append(AllBlocksCleared())


def check_hashes(node: RadixNode, page_size: int) -> None:
    if node.hashes is None or len(node.hashes) != len(node.key) // page_size:
        raise RadixCacheError(f"{node!r} has no block hash per page")
