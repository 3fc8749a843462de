"""Sliding-window memory (kv/sliding.py): the freeing rule, the cut-back
prefix match, tombstones and their eviction, and every way a request gives
its pages back (finish, abort, retraction, worker loss)."""

from __future__ import annotations

import pytest

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.ids import id_array
from scheduler_service.core.kv.events import BlockRemoved, BlockStored
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.kv.sliding import SlidingPages, freeable_below
from tests.scheduler_service.core.support.sim_driver import check_drained, drive, make_pair

V = 40


def config(page_size: int, **kw) -> SchedulerConfig:
    kw.setdefault("chunked_prefill_size", 8 * page_size)
    return SchedulerConfig(page_size=page_size, eos_token_ids=frozenset({0}), vocab_size=V, **kw)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [1 + (seed * 7 + i * 13) % (V - 1) for i in range(n)]


def one_step(sched, worker) -> None:
    plan = sched.step()
    sched.update(worker.execute(plan))
    sched.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_behind_the_window_are_freed_and_the_rest_kept(page_size):
    """After every step, entry i is 0 exactly when (i + 1) * page_size <=
    kv_len - window + 1 (and the simulated worker, which checks every
    query's window, never reads a freed page)."""
    window = 3 * page_size + 2
    sched, worker = make_pair(config(page_size), 64, V, num_swa_pages=32, swa_window=window)
    req = Request(
        "a", prompt(10 * page_size + 3), SamplingParams(max_new_tokens=40, ignore_eos=True)
    )
    sched.add_request(req)
    seen = set()
    while not req.finished:
        one_step(sched, worker)
        if req.finished:
            break
        kv_len = req.kv_len
        freed = [i for i, p in enumerate(req.swa_pages) if p == 0]
        rule = [i for i in range(len(req.pages)) if (i + 1) * page_size <= kv_len - window + 1]
        assert freed == rule, (kv_len, freed, rule)
        seen.add(len(freed))
    assert len(seen) > 3  # pages were freed as it went, not all at once
    held = sched.sliding.num_pages - 1 - sched.sliding.num_free - sched.sliding.tree_only
    assert held == 0
    drive(sched, worker, [])  # the worker is told it left
    check_drained(sched, worker)


def test_freeable_below_is_transformers_visibility():
    # Key k is visible to query q iff q - window < k <= q: the next query sits
    # at kv_len, so positions <= kv_len - window are invisible.
    for page_size in (1, 4, 16):
        for window in (1, 5, 16, 17):
            for kv_len in range(0, 80):
                upto = freeable_below(kv_len, window, page_size)
                for i in range(kv_len // page_size + 1):
                    last = (i + 1) * page_size - 1
                    invisible = last < kv_len - window + 1
                    assert (i < upto) == invisible, (page_size, window, kv_len, i)


def sliding_cache(page_size: int, window: int, num_swa: int = 64, events: bool = False):
    pool = PagePool(256, page_size)
    sliding = SlidingPages(num_swa, page_size, window)
    cache = RadixCache(page_size, pool, enable_events=events, sliding=sliding)
    return pool, sliding, cache


def store(pool, sliding, cache, key, tombstones=(), extra_key=None):
    """Insert ``key`` as a finished request would: its own full pages, its
    sliding pages except at ``tombstones`` (freed), then its references
    dropped (the cache keeps its own)."""
    n = len(key) // cache.page_size
    pages = pool.alloc(n)
    swa = sliding.alloc(n)
    for i in tombstones:
        sliding.release([swa[i]])
        swa[i] = 0
    result = cache.insert(id_array(key), pages, extra_key, swa=swa)
    pool.release(result.dup_pages)
    sliding.release(swa)
    return swa


@pytest.mark.parametrize("page_size", [1, 16])
def test_match_is_cut_back_to_a_prefix_whose_window_is_held(page_size):
    window = 3 * page_size  # a prefix of k pages needs entries [k - 2, k) (k - 3 when aligned)
    pool, sliding, cache = sliding_cache(page_size, window)
    key = prompt(10 * page_size)
    store(pool, sliding, cache, key, tombstones=[5])
    usable = []
    for k in range(11):
        m = cache.match(id_array(key), limit=k * page_size, touch=False)
        usable.append(m.length // page_size)
    # Reusable lengths: k <= 5 (the window stops before page 5) and k >= 8
    # (its window [k*ps - window + 1, k*ps) starts after page 5).
    lo = [k for k in range(11) if k <= 5 or freeable_below(k * page_size, window, page_size) > 5]
    assert usable == [max(j for j in lo if j <= k) for k in range(11)]
    assert usable[7] == 5 and usable[10] == 10
    # With touch (admission) the edge is split exactly at the cut.
    m = cache.match(id_array(key), limit=7 * page_size)
    assert m.length == 5 * page_size and len(m.node.key) + 0 <= 5 * page_size
    assert list(m.swa) == list(m.swa) and 0 not in m.swa[-2:]
    cache.check_integrity()


def test_sliding_eviction_tombstones_lru_pages_and_keeps_shared_ones():
    page_size, window = 1, 4
    pool, sliding, cache = sliding_cache(page_size, window, num_swa=40)
    old = prompt(12, seed=1)
    new = prompt(12, seed=2)
    store(pool, sliding, cache, old)
    store(pool, sliding, cache, new)
    assert sliding.tree_only == 24 and sliding.num_free == 40 - 1 - 24
    # A running request reads the last window of `new`: it holds those.
    m = cache.match(id_array(new))
    reader = list(m.swa[-3:])
    sliding.share(reader)
    full_before = cache.cached_pages
    freed = cache.evict_swa(14)
    assert freed >= 14
    assert cache.cached_pages == full_before  # full pages untouched
    # `old` (least recent) went first; the reader's pages stayed cached.
    assert cache.match(id_array(old), touch=False).length == 0
    m2 = cache.match(id_array(new), touch=False)
    assert all(p in m2.swa for p in reader)
    assert m2.length >= len(new) - (window - 1) or m2.length == 0
    # Everything the reader does not hold can go; its pages cannot.
    cache.evict_swa(100)
    assert sliding.tree_only == 0 and sliding.tree_held == 3
    sliding.release(reader)
    assert sliding.tree_only == 3
    holders: dict[int, int] = {}
    tree: dict[int, int] = {}
    cache.check_integrity({}, tree)
    holders.update(tree)
    sliding.check_integrity(holders, tree)


def test_a_freed_tombstone_is_revived_by_a_request_that_holds_the_page():
    pool, sliding, cache = sliding_cache(1, 4)
    key = prompt(10)
    store(pool, sliding, cache, key, tombstones=[8])
    assert cache.match(id_array(key), touch=False).length == 8
    # Another request computed the same tokens and still holds page 8's slot.
    store(pool, sliding, cache, key)
    assert cache.match(id_array(key), touch=False).length == 10
    cache.check_integrity()


def test_kv_events_announce_only_reusable_prefixes():
    page_size, window = 1, 3
    pool, sliding, cache = sliding_cache(page_size, window, events=True)
    key = prompt(10)
    store(pool, sliding, cache, key, tombstones=[0, 1, 2, 3, 4])
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    announced = sum(len(e.block_hashes) for e in stored)
    # Prefix k (pages) is reusable iff entries [k - 2, k) are held: k = 7..10.
    assert announced == 4
    assert stored[0].token_ids == key[6:10]
    # Evicting the sliding pages withdraws them.
    cache.evict_swa(100)
    removed = [
        h for e in cache.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert set(stored[0].block_hashes) <= set(removed)


def test_abort_retraction_and_worker_loss_return_both_pools():
    page_size = 16
    sched, worker = make_pair(
        config(page_size, max_running_requests=4, init_new_token_ratio=0.01),
        40,
        V,
        num_swa_pages=60,
        swa_window=20,
    )
    reqs = [
        Request(
            f"r{i}", prompt(80 + 9 * i, seed=i), SamplingParams(max_new_tokens=120, ignore_eos=True)
        )
        for i in range(4)
    ]
    for r in reqs:
        sched.add_request(r)
    for _ in range(12):
        one_step(sched, worker)
    sliding = sched.sliding
    running = [r for r in reqs if r.swa_pages]
    assert running
    victim = running[0]
    held = sum(1 for p in victim.swa_pages if p)
    before = sliding.num_free + sliding.tree_only
    sched.abort(victim.rid)
    sched.check_integrity()
    assert victim.swa_pages == id_array() and held > 0
    assert sliding.num_free + sliding.tree_only == before + held
    # Drive the rest: the tiny full pool forces retractions.
    log = drive(sched, worker, [], overlap=True)
    assert sched.stats.retractions > 0 and log is not None
    check_drained(sched, worker)
    # Worker loss while requests hold pages: the pools come back whole.
    sched2, worker2 = make_pair(config(page_size), 40, V, num_swa_pages=14, swa_window=20)
    for i in range(2):
        sched2.add_request(
            Request(f"w{i}", prompt(50, seed=i), SamplingParams(max_new_tokens=30, ignore_eos=True))
        )
    for _ in range(3):
        one_step(sched2, worker2)
    assert sched2.sliding.num_free < 13
    lost = sched2.reset_after_worker_loss()
    assert lost and all(not r.swa_pages for r in lost)
    assert sched2.sliding.num_free == 13 and sched2.sliding.tree_held == 0
    sched2.check_integrity()
    sched2.resize_pool(40, 20)
    assert sched2.sliding.num_free == 19
    with pytest.raises(RuntimeError):
        sched2.resize_pool(40, 0)  # the worker lost its sliding layers: another model


def test_long_requests_run_together_when_only_their_windows_fit_the_sliding_pool():
    """The sliding pool holds a window a request, not its whole length: with
    room for 3 windows but not 2 whole prompts, 3 long requests run at once
    (the full pool has room for all)."""
    page_size, window = 16, 64
    sched, worker = make_pair(
        config(page_size, chunked_prefill_size=128, max_prefill_tokens=128),
        400,
        V,
        num_swa_pages=1 + 3 * (window // page_size + 1) + 128 // page_size + 2,
        swa_window=window,
    )
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = [Request(f"r{i}", prompt(1000, seed=i), sp) for i in range(3)]
    assert sched.sliding.num_pages * page_size < 2 * 1000
    most = 0
    for r in reqs:
        sched.add_request(r)
    while not all(r.finished for r in reqs):
        one_step(sched, worker)
        most = max(most, len(sched.table.running))
    assert most == 3


def test_no_preemption_for_a_request_the_sliding_pool_cannot_take():
    """A higher-priority request preempts a running one only if the sliding
    budget takes it afterwards; a wasted preemption repeated every step (the
    order policy puts the preempted request first again) was a livelock."""
    cfg = config(
        16,
        chunked_prefill_size=16,
        max_prefill_tokens=16,
        schedule_policy="dfs-weight",
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
    )
    sched, worker = make_pair(cfg, 64, V, num_swa_pages=6, swa_window=20)
    low = Request("low", prompt(28, seed=1), SamplingParams(max_new_tokens=30), priority=20)
    high = Request("high", prompt(17, seed=2), SamplingParams(max_new_tokens=30), priority=0)
    log = drive(sched, worker, [(0, low), (1, high)], overlap=True, max_steps=2000)
    assert low.finished and high.finished and log.steps < 2000
    assert sched.stats.preemptions <= 1
    check_drained(sched, worker)


def test_attaching_a_cached_prefix_counts_the_sliding_pages_it_takes_from_the_evictable():
    """A cached sliding page no request holds counts as available; the
    request that attaches it takes it, so admission must not count it again
    for the request's new pages (it planned a page that was not there)."""
    sched, worker = make_pair(
        config(16, chunked_prefill_size=None), 10, V, num_swa_pages=4, swa_window=16
    )
    shared = prompt(16, seed=5)
    scoring = SamplingParams(max_new_tokens=0)
    first = Request("c", [*shared, 3, 4], scoring)
    sched.add_request(first)
    while not first.finished:
        one_step(sched, worker)
    drive(sched, worker, [])
    sliding = sched.sliding
    assert (sliding.num_free, sliding.tree_only) == (2, 1)  # its first page stays cached
    other = Request("a", prompt(18, seed=6), scoring)
    sched.add_request(other)
    in_flight = sched.step()  # takes the 2 free sliding pages; not answered yet
    assert sliding.num_free == 0
    again = Request("b", [*shared, 7, 8], scoring)
    sched.add_request(again)
    plan = sched.step()  # nothing runs: would take the cached page and then find none
    assert plan is None or again.rid not in {e.rid for e in plan.entries}
    sched.check_integrity()
    sched.update(worker.execute(in_flight))
    if plan is not None:
        sched.update(worker.execute(plan))
    drive(sched, worker, [])
    assert again.finished and again.cached_tokens == 16
    check_drained(sched, worker)
