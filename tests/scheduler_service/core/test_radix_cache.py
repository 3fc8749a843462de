from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache, RadixCacheError


def make(num_pages=64, page_size=1, events=False):
    pool = PagePool(num_pages, page_size)
    return pool, RadixCache(page_size, pool, enable_events=events)


def put(pool, cache, key, extra_key=None):
    """Insert key with fresh pages for the part not cached; return the result."""
    page_size = cache.page_size
    m = cache.match(key, extra_key)
    fresh = pool.alloc(len(key) // page_size - len(m.pages))
    result = cache.insert(key, m.pages + fresh, extra_key)
    assert result.dup_pages.tolist() == []
    return result


def check(pool, cache):
    holders: dict[int, int] = {}
    cache.check_integrity(holders)
    pool.check_integrity(holders)


def test_match_and_insert_share_prefixes():
    pool, cache = make()
    put(pool, cache, [1, 2, 3, 4])
    put(pool, cache, [1, 2, 5])
    m = cache.match([1, 2, 3, 9])
    assert m.length == 3 and len(m.pages) == 3
    assert cache.match([1, 2, 5, 6]).length == 3
    assert cache.match([7]).length == 0
    assert cache.cached_pages == 5  # 1,2 shared; 3,4 and 5 apart
    check(pool, cache)


def test_match_limit_and_split_node_ends_at_the_match():
    pool, cache = make()
    put(pool, cache, [1, 2, 3, 4, 5])
    m = cache.match([1, 2, 3, 4, 5], limit=2)
    assert m.length == 2 and m.node.key.tolist() == [1, 2]
    assert cache.num_nodes == 2  # split into [1,2] + [3,4,5]
    peek = cache.match([1, 2, 3, 9], touch=False)
    assert peek.length == 3 and cache.num_nodes == 2  # peeking never splits
    check(pool, cache)


def test_page_aligned_keys_only():
    pool, cache = make(page_size=4)
    put(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 9]).length == 4  # the partial page never matches
    assert cache.match([1, 2, 3]).length == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8], limit=7).length == 4
    with pytest.raises(RadixCacheError, match="page-aligned"):
        cache.insert([1, 2, 3], [0])
    check(pool, cache)


def test_insert_returns_duplicates():
    pool, cache = make()
    put(pool, cache, [1, 2, 3])
    mine = pool.alloc(4)
    result = cache.insert([1, 2, 3, 4], mine)
    assert result.prefix_len == 3 and result.dup_pages == mine[:3]
    pool.release(result.dup_pages)
    assert cache.cached_pages == 4
    check(pool, cache)


def test_locks_protect_the_path_and_move_the_accounting():
    pool, cache = make()
    leaf = put(pool, cache, [1, 2, 3]).node
    other = put(pool, cache, [1, 2, 4]).node
    assert (cache.evictable_pages, cache.protected_pages) == (4, 0)
    cache.lock(leaf)
    assert (cache.evictable_pages, cache.protected_pages) == (1, 3)
    assert cache.evict(10) == 1  # only [4] could go
    assert cache.match([1, 2, 4]).length == 2 and other.parent is None
    cache.unlock(leaf)
    assert cache.evictable_pages == 3
    with pytest.raises(RadixCacheError, match="unlock"):
        cache.unlock(leaf)
    assert cache.evict(10) == 3 and cache.cached_pages == 0
    check(pool, cache)


def test_eviction_is_least_recently_used_first():
    pool, cache = make()
    for first in (1, 2, 3):
        put(pool, cache, [first, 10, 11])
    cache.match([1, 10, 11])  # 1 is now the most recent
    cached = lambda key: cache.match(key, touch=False).length  # noqa: E731
    cache.evict(3)
    assert cached([2, 10, 11]) == 0
    assert cached([1, 10, 11]) == 3 and cached([3, 10, 11]) == 3
    cache.evict(3)
    assert cached([3, 10, 11]) == 0  # 3 was older than 1
    assert cached([1, 10, 11]) == 3
    check(pool, cache)


def test_a_parent_becomes_evictable_when_its_children_go():
    pool, cache = make()
    put(pool, cache, [1, 2, 3])
    put(pool, cache, [1, 2, 4])
    assert cache.evict(2) == 2  # the two leaves [3] and [4]
    assert cache.match([1, 2]).length == 2
    assert cache.evict(1) == 2  # then [1, 2]
    assert cache.cached_pages == 0 and pool.num_free == 64
    check(pool, cache)


def test_extra_key_namespaces_never_share():
    pool, cache = make()
    put(pool, cache, [1, 2, 3], extra_key="tenant-a")
    assert cache.match([1, 2, 3]).length == 0
    assert cache.match([1, 2, 3], extra_key="tenant-b").length == 0
    assert cache.match([1, 2, 3], extra_key="tenant-a").length == 3
    put(pool, cache, [1, 2, 3])
    assert cache.cached_pages == 6
    cache.evict(6)
    assert len(cache.roots()) == 1  # empty namespaces are dropped
    check(pool, cache)


def test_events_name_blocks_by_chained_hashes():
    pool, cache = make(page_size=2, events=True)
    put(pool, cache, [1, 2, 3, 4])
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 2
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2
    put(pool, cache, [1, 2, 3, 4, 5, 6])
    (ext,) = cache.take_events()
    assert ext.parent_block_hash == stored.block_hashes[-1] and ext.token_ids == [5, 6]
    cache.evict(3)
    removed = cache.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        stored.block_hashes + ext.block_hashes
    )
    # The same prefix hashes the same however it was built; a namespace differs.
    put(pool, cache, [1, 2])
    put(pool, cache, [1, 2, 3, 4, 5, 6])
    rebuilt = [h for e in cache.take_events() for h in e.block_hashes]
    assert rebuilt == stored.block_hashes + ext.block_hashes
    put(pool, cache, [1, 2], extra_key="k")
    (ns,) = cache.take_events()
    assert ns.block_hashes[0] != stored.block_hashes[0] and ns.extra_key == "k"
    cache.reset()
    assert isinstance(cache.take_events()[-1], AllBlocksCleared)


def test_event_buffer_is_bounded():
    pool = PagePool(64, 1)
    cache = RadixCache(1, pool, enable_events=True, max_events=4)
    for i in range(10):
        put(pool, cache, [i])
    assert len(cache.take_events()) == 4 and cache.events.dropped == 6


def test_the_eviction_heap_does_not_grow_without_bound():
    pool, cache = make()
    put(pool, cache, [1, 2, 3])
    for _ in range(20_000):
        cache.match([1, 2, 3])
    assert len(cache._heap) < 2_000
    check(pool, cache)


def test_integrity_check_catches_drift():
    pool, cache = make()
    node = put(pool, cache, [1, 2, 3]).node
    cache.evictable_pages += 1
    with pytest.raises(RadixCacheError, match="accounting"):
        check(pool, cache)
    cache.evictable_pages -= 1
    node.lock_ref = 1  # a lock nobody accounted for
    with pytest.raises(RadixCacheError):
        check(pool, cache)


# ---------------------------------------------------------------- property
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 12)),
    ),
    max_size=60,
)


def block_map(cache):
    """prefix tuple (per page) -> page id, read off the tree."""
    out = {}
    for root in cache.roots():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            ps = cache.page_size
            for i, page in enumerate(node.pages):
                out[prefix + tuple(node.key[: (i + 1) * ps])] = page
            for child in node.children.values():
                stack.append((child, prefix + tuple(node.key)))
    return out


def evict_and_forget(cache, n, reference, locked) -> int:
    """Evict, check only unlocked blocks went, and drop them from the reference."""
    before = block_map(cache)
    freed = cache.evict(n)
    gone = set(before) - set(block_map(cache))
    assert freed == len(gone)
    for node in locked:  # locked paths survive
        assert node.parent is not None
    for k in gone:
        del reference[k]
    return freed


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 2]), ops)
def test_random_operations_keep_the_cache_consistent(page_size, operations):
    pool, cache = make(num_pages=40, page_size=page_size)
    reference: dict[tuple, int] = {}  # what inserts stored and evictions did not remove
    locked = []
    for op, arg in operations:
        if op == "insert" or op == "lock":
            key = arg[: len(arg) - len(arg) % page_size]
            if not key:
                continue
            m = cache.match(key)
            need = len(key) // page_size - len(m.pages)
            cache.lock(m.node)  # keep the matched prefix while evicting for the rest
            if need > pool.num_free + cache.evictable_pages:
                cache.unlock(m.node)
                continue
            short = need - pool.num_free
            if short > 0:
                assert evict_and_forget(cache, short, reference, locked) >= short
            fresh = pool.alloc(need)
            cache.unlock(m.node)
            result = cache.insert(key, m.pages + fresh)
            assert result.dup_pages.tolist() == []
            for i in range(len(key) // page_size):
                reference[tuple(key[: (i + 1) * page_size])] = (m.pages + fresh)[i]
            if op == "lock":
                cache.lock(result.node)
                locked.append(result.node)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(arg % len(locked)))
        elif op == "evict":
            freed = evict_and_forget(cache, arg, reference, locked)
            assert freed >= arg or cache.evictable_pages == 0
        check(pool, cache)
        assert block_map(cache) == reference
