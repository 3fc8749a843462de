"""The radix cache's packed storage: token ids and page ids as 32-bit arrays
(memory, GC traversal, the bulk duplicate-page check, 32-bit limits) and the
requests' packed token arrays the cache is called with."""

from __future__ import annotations

import gc
import random
import tracemalloc
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.ids import IdRangeError, id_array
from scheduler_service.core.kv.id_runs import differing_pages
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import InvalidRequestError


def check(pool: PagePool, cache: RadixCache) -> None:
    holders: dict[int, int] = {}
    cache.check_integrity(holders)
    pool.check_integrity(holders)


def put(pool: PagePool, cache: RadixCache, key) -> None:
    m = cache.match(key)
    result = cache.insert(key, m.pages + pool.alloc(len(key) - m.length))
    assert len(result.dup_pages) == 0


def test_nodes_hold_packed_ids_that_the_collector_does_not_walk():
    """100k cached tokens: a few bytes a token (lists of int objects took ~50)
    and a handful of GC-tracked objects per node (no list of ids per node)."""
    rng = random.Random(7)
    pool = PagePool(120_000, 1)
    cache = RadixCache(1, pool)
    systems = [[rng.randrange(128_256) for _ in range(1000)] for _ in range(10)]
    seqs = [
        id_array(rng.choice(systems) + [rng.randrange(128_256) for _ in range(300)])
        for _ in range(300)
    ]
    gc.collect()
    tracked_before = len(gc.get_objects())
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for seq in seqs:
        put(pool, cache, seq)
    retained = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tracked = len(gc.get_objects()) - tracked_before
    tokens = cache.cached_pages
    assert tokens == 10 * 1000 + 300 * 300
    assert retained / tokens < 16
    assert tracked <= 5 * cache.num_nodes + 64
    for root in cache.roots():
        for node in root.children.values():
            assert type(node.key) is array and type(node.pages) is array
    check(pool, cache)


def test_the_cache_copies_what_it_keeps_from_a_callers_array():
    pool = PagePool(64, 1)
    cache = RadixCache(1, pool)
    key = id_array([1, 2, 3])
    pages = pool.alloc(3)
    cache.insert(key, pages)
    key.append(4)  # a request's token array grows as outputs arrive
    pages[0] = 63
    assert cache.match([1, 2, 3, 4]).length == 3
    assert cache.match([1, 2, 3]).pages.tolist() == [0, 1, 2]
    check(pool, cache)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=80), st.data())
def test_the_bulk_duplicate_check_matches_the_per_page_loop(cached, data):
    n = len(cached)
    shape = data.draw(st.sampled_from(["prefix-then-own", "random", "sprinkled"]))
    if shape == "prefix-then-own":
        k = data.draw(st.integers(0, n - 1))
        mine = cached[:k] + [q + 1 if q < 2**31 - 1 else q - 1 for q in cached[k:]]
    elif shape == "random":
        mine = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
    else:  # own pages with some equal to the cached one at random places
        mine = [q ^ 1 for q in cached]
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=n)):
            mine[i] = cached[i]
    if mine == cached:
        return  # the cache only calls it when the runs differ
    got = differing_pages(id_array(mine), id_array(cached))
    assert got.tolist() == [p for p, q in zip(mine, cached, strict=True) if p != q]


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_reports_the_same_duplicates_as_the_per_page_loop(page_size):
    pool = PagePool(512, page_size)
    cache = RadixCache(page_size, pool)
    key = list(range(100, 100 + 40 * page_size))
    m = cache.match(key)
    cache.insert(key, pool.alloc(40))
    cached = cache.match(key, touch=False).pages.tolist()
    own = pool.alloc(40).tolist()
    for mine in (
        cached[:13] + own[13:],  # a matched prefix, then own pages
        own,
        [c if i % 3 else o for i, (c, o) in enumerate(zip(cached, own, strict=True))],
    ):
        result = cache.insert(key, mine)
        assert result.prefix_len == len(key)
        want = [p for p, q in zip(mine, cached, strict=True) if p != q]
        assert result.dup_pages.tolist() == want
    assert m.length == 0
    pool.release(own)
    check(pool, cache)


def test_ids_beyond_32_bits_are_refused_cleanly():
    pool = PagePool(64, 1)
    cache = RadixCache(1, pool)
    with pytest.raises(IdRangeError, match="32-bit"):
        cache.insert([2**31], [0])
    with pytest.raises(IdRangeError, match="32-bit"):
        cache.match([-(2**31) - 1])
    check(pool, cache)
    assert pool.num_free == 64


def test_a_request_packs_its_tokens_once_and_appends_its_outputs():
    req = Request("r", [5, 6, 7])
    packed = req.token_array()
    assert packed.tolist() == [5, 6, 7] and req.token_array() is packed
    req.output_ids.append(8)
    req.output_ids.append(9)
    assert req.token_array() is packed and packed.tolist() == [5, 6, 7, 8, 9]


def test_a_prompt_beyond_32_bit_ids_is_an_invalid_request():
    with pytest.raises(InvalidRequestError, match="32-bit"):
        Request("r", [1, 2**40]).validate()
