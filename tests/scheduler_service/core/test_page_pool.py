from __future__ import annotations

import pytest

from scheduler_service.core.kv.page_pool import PagePool, PagePoolError


def test_alloc_release_and_ref_counts():
    pool = PagePool(num_pages=8, page_size=4)
    a = pool.alloc(3)
    assert a.tolist() == [0, 1, 2] and pool.num_free == 5 and pool.num_used == 3
    assert [pool.refcount(p) for p in a] == [1, 1, 1] and pool.refcount(7) == 0
    pool.share(a[:2])
    assert pool.refcount(0) == 2
    pool.release(a)
    assert pool.num_free == 6 and pool.refcount(0) == 1 and pool.refcount(2) == 0
    pool.release(a[:2])
    assert pool.num_free == 8
    pool.check_integrity({})


def test_alloc_fails_cleanly_when_short():
    pool = PagePool(4, 1)
    assert pool.alloc(5) is None and pool.num_free == 4
    assert pool.alloc(0).tolist() == []


def test_double_free_is_caught():
    pool = PagePool(4, 1)
    pages = pool.alloc(2)
    pool.release(pages)
    pool.release(pages[:1])
    with pytest.raises(PagePoolError, match="double free"):
        pool.check_integrity()


def test_leaks_and_double_ownership_are_caught_against_holders():
    pool = PagePool(4, 1)
    pages = pool.alloc(2)
    with pytest.raises(PagePoolError, match="page 1"):
        pool.check_integrity({pages[0]: 1})  # page 1 held by nobody: leaked
    with pytest.raises(PagePoolError, match="page 0"):
        pool.check_integrity({pages[0]: 2, pages[1]: 1})  # two owners, ref count 1
    with pytest.raises(PagePoolError, match="free"):
        pool.check_integrity({0: 1, 1: 1, 3: 1})  # a free page claimed by someone
    pool.check_integrity({0: 1, 1: 1})


def test_reset_frees_everything():
    pool = PagePool(4, 2)
    pool.share(pool.alloc(3))
    pool.reset()
    assert pool.num_free == 4
    pool.check_integrity({})
