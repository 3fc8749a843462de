"""The radix cache's KV-event bookkeeping (kv_events.py has the events).

With events on, every cached node carries one chained block hash per page
(``RadixNode.hashes``): a new leaf's pages are hashed from its parent's last
hash (or its namespace's seed) and logged as stored, a split divides the
hashes with the pages, an evicted leaf's hashes are logged as removed, and a
reset logs that everything is gone.
"""

from __future__ import annotations

from array import array

from scheduler_service.core.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    chain_page_hashes,
    namespace_seed,
)
from scheduler_service.core.kv.radix_node import HASH_TYPE, RadixCacheError, RadixNode


def log_stored(events: EventLog, parent: RadixNode, leaf: RadixNode, page_size: int) -> None:
    """Hash the pages of ``leaf`` (just added under ``parent``) and log them."""
    parent_hash = parent.hashes[-1] if parent.hashes else None
    seed = parent_hash if parent_hash is not None else namespace_seed(parent.namespace)
    hashes = chain_page_hashes(seed, leaf.key, page_size)
    leaf.hashes = array(HASH_TYPE, hashes)
    events.append(BlockStored(hashes, parent_hash, leaf.key.tolist(), page_size, parent.namespace))


def split_hashes(upper: RadixNode, node: RadixNode, pages: int) -> None:
    """``upper`` took the first ``pages`` pages of ``node``: their hashes too."""
    if node.hashes is not None:
        upper.hashes = node.hashes[:pages]
        node.hashes = node.hashes[pages:]


def log_removed(events: EventLog, node: RadixNode) -> None:
    """``node`` was evicted: its pages leave the cache."""
    if node.hashes:
        events.append(BlockRemoved(node.hashes.tolist()))


def log_cleared(events: EventLog) -> None:
    events.append(AllBlocksCleared())


def check_hashes(node: RadixNode) -> None:
    if node.hashes is None or len(node.hashes) != len(node.pages):
        raise RadixCacheError(f"{node!r} has no block hash per page")
