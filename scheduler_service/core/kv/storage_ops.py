"""The file tier's operations on the tree (kv/storage_tier.py describes the
tier): block hashes of any node, the backup of a node copied to the host,
starting a request's prefetch, and putting a reported prefetch's pages
into the tree. Functions of a HiRadixCache (typed loosely, as
hicache_integrity.py is, so the modules need not import each other).

Hashes: a file's name is the block's chained hash (kv/events.py), the
one KV events give the gateway. With events on every node has them; with
events off a node gets them when the file tier first needs them
(``node_hashes``: chained from its nearest hashed ancestor, the same
values), and splits keep them.

Finishing a prefetch walks the tree again by the prefix's tokens (nothing
in the tree is held for it while it is out): if the part before the read
pages is no longer all in the tree, the pages are dropped; pages whose
tokens the tree meanwhile got (device or host) are freed as duplicates;
the rest become one host-only leaf, stored on the host (event), whose load
to the device is the host tier's.
"""

from __future__ import annotations

from array import array
from typing import Any

from scheduler_service.core.ids import BLOCK_HASH_TYPE, StorageReadsDone
from scheduler_service.core.kv.events import (
    BlockRemoved,
    Medium,
    chain_page_hashes,
    namespace_seed,
)
from scheduler_service.core.kv.id_runs import common_len
from scheduler_service.core.kv.radix_events import log_node_stored
from scheduler_service.core.kv.radix_node import RadixNode
from scheduler_service.core.kv.storage_tier import MAX_PREFETCHES_PER_REQUEST, Prefetch


def node_hashes(cache: Any, node: RadixNode) -> array:
    """``node``'s block hashes (computed and kept if it had none)."""
    if node.hashes is not None:
        return node.hashes
    path: list[RadixNode] = []
    x: RadixNode | None = node
    while x is not None and x.parent is not None and x.hashes is None:
        path.append(x)
        x = x.parent
    if x is None or x.parent is None:
        seed = namespace_seed(node.namespace)
    else:
        seed = x.hashes[-1] if x.hashes else namespace_seed(node.namespace)
    for y in reversed(path):
        y.hashes = array(BLOCK_HASH_TYPE, chain_page_hashes(seed, y.key, cache.page_size))
        seed = y.hashes[-1] if y.hashes else seed
    return node.hashes


def _forgotten(cache: Any, hashes: list[int]) -> None:
    if hashes and cache.events is not None:
        cache.events.append(BlockRemoved(hashes, Medium.STORAGE))


def plan_backup(cache: Any, node: RadixNode) -> None:
    """``node`` was just given a host copy on the plan being built: write
    its blocks the files lack, after that copy."""
    tier = cache.storage
    hashes = node_hashes(cache, node)
    index = tier.index
    forgot: list[int] = []
    wrote = False
    for h, page in zip(hashes, node.host, strict=True):
        if h in index:
            index.touch(h)
            continue
        forgot += tier.plan_write(h, page)
        wrote = True
    _forgotten(cache, forgot)
    if wrote and cache.events is not None:
        log_node_stored(cache.events, node, cache.page_size, Medium.STORAGE)


def host_pages_dropped(cache: Any, host: array) -> None:
    """A node's host pages were freed while the plan is built: no write of
    them may go out."""
    _forgotten(cache, cache.storage.cancel_writes(host))


def hold_for_prefetch(cache: Any, req: Any) -> bool:
    """Whether admission passes ``req`` over this step because its prefetch
    is out (starting one if its match continues in the files), as the
    tier's policy says; its ``match_*`` fields are as ``match`` set them."""
    tier = cache.storage
    out = tier.by_rid.get(req.rid)
    if out is not None:
        if out.released:
            return False
        if tier.may_stop_waiting(out):
            out.released = True
            tier.stats.timeouts += 1
            return False
        return True
    if req.storage_prefetches >= MAX_PREFETCHES_PER_REQUEST:
        return False
    page_size = cache.page_size
    pos = req.match_len + req.match_host_len
    limit = req.max_prefix_len()
    limit -= limit % page_size
    if limit - pos < tier.threshold:
        return False
    node = req.match_host_node if req.match_host_node is not None else req.match_node
    if node is None:
        return False
    if node.parent is None:  # nothing matched (``node`` may be another namespace's root)
        node = cache._roots.get(req.extra_key)
        if node is None:
            node = cache._root(req.extra_key)
    hashes = _stored_run(cache, node, req.token_array(), pos=pos, limit=limit)
    if len(hashes) * page_size < tier.threshold:
        return False
    protect = node.pages is None and node.parent is not None
    if protect:  # host eviction below must not take the match's end
        node.host_ref += 1
    host = cache._host_alloc(len(hashes))
    if protect:
        node.host_ref -= 1
        cache._refresh(node)
    if host is None:
        return False
    end = pos + len(hashes) * page_size
    prefetch = Prefetch(
        req.rid, node.namespace, req.token_array()[:end], pos, hashes, host, tier.clock()
    )
    tier.plan_read(prefetch)
    req.storage_prefetches += 1
    if tier.policy == "best_effort":
        prefetch.released = True
        return False
    return True


def _stored_run(cache: Any, node: RadixNode, tokens: array, *, pos: int, limit: int) -> array:
    """Hashes of the pages of ``tokens`` from ``pos`` (where ``node``, the
    match's end, ends) that the index holds, up to the first it lacks."""
    page_size = cache.page_size
    h = namespace_seed(node.namespace) if node.parent is None else node_hashes(cache, node)[-1]
    index = cache.storage.index
    out = array(BLOCK_HASH_TYPE)
    for at in range(pos, limit, page_size):
        h = chain_page_hashes(h, tokens[at : at + page_size], page_size)[0]
        if h not in index:
            break
        out.append(h)
    return out


def apply_reports(cache: Any, reports: list[StorageReadsDone]) -> None:
    """The worker finished these plans' reads: each prefetch's pages that
    came whole go into the tree (``finish_prefetch``); failed blocks leave
    the index (and the router's view of the files)."""
    tier = cache.storage
    for done in reports:
        for prefetch, good, bad in tier.reported(done):
            finish_prefetch(cache, prefetch, good)
            _forgotten(cache, bad)


def finish_prefetch(cache: Any, prefetch: Prefetch, good: int) -> int:
    """The worker reported ``prefetch``: its first ``good`` pages came whole.
    Put what the tree lacks of them in it as a host-only leaf and free the
    rest; returns how many pages the tree took."""
    page_size = cache.page_size
    key, start, host = prefetch.key, prefetch.start, prefetch.host
    end = start + good * page_size
    node, pos = _walk(cache, prefetch.namespace, key, end, create=start == 0 and good > 0)
    if node is None or pos < start:  # the prefix before the read pages left the tree
        cache.storage.stats.dropped_pages += good
        cache.host_pool.release(host)
        return 0
    first = (pos - start) // page_size  # pages the tree got meanwhile
    if first < good:
        host_only = None  # no device pages
        leaf = RadixNode(key[pos:end], host_only, node, node.namespace)  # type: ignore[arg-type]
        leaf.host = host[first:good]
        leaf.hashes = prefetch.hashes[first:good]
        leaf.last_access = cache._clock
        node.children[cache._child_key(leaf.key, 0)] = leaf
        cache._num_nodes += 1
        if cache.events is not None:
            log_node_stored(cache.events, leaf, page_size, Medium.HOST)
        cache._refresh(leaf)
    cache.host_pool.release(host[:first] + host[good:])
    return max(good - first, 0)


def _walk(
    cache: Any, namespace: str | None, key: array, end: int, *, create: bool
) -> tuple[RadixNode | None, int]:
    """The deepest node along ``key[:end]`` and where it ends, splitting an
    edge that leaves the key before ``end`` (a leaf goes there)."""
    node = cache._roots.get(namespace)
    if node is None:
        if not create:
            return None, 0
        node = cache._root(namespace)
    page_size = cache.page_size
    now = cache._tick()
    pos = 0
    while pos < end:
        child = node.children.get(cache._child_key(key, pos))
        if child is None:
            break
        edge = child.key
        m = common_len(key, pos, edge, min(len(edge), end - pos))
        m -= m % page_size
        if m == 0:
            break
        split = m < len(edge) and pos + m < end
        if split:
            child = cache._split(child, m)
        pos += m
        node = child
        cache._touch(child, now)
        if split:
            break
    return node, pos
