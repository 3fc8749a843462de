"""The host tier (kv/hiradix_cache.py): write policies, device eviction to the
host, host eviction, matches that report the host part, load back and its
locks, copies riding on plans, KV events by medium; then the scheduler with
the tier on (loads budgeted by admission, copies on plans, the tier off
unchanged). The property tests run the tier under random workloads
(test_scheduler_properties.py) and worker losses mid-copy
(test_worker_loss.py)."""

from __future__ import annotations

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.admission.adder import AddResult, PrefillAdder
from scheduler_service.core.admission.decision import match_prefix
from scheduler_service.core.ids import id_array
from scheduler_service.core.kv.events import BlockRemoved, BlockStored, Medium
from scheduler_service.core.kv.hiradix_cache import HiRadixCache
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)


def tiered(
    hits: int | None = 1, device: int = 16, host: int = 32, threshold: int = 0
) -> HiRadixCache:
    return HiRadixCache(
        1,
        PagePool(device, 1),
        PagePool(host, 1),
        hits_to_write=hits,
        load_back_threshold=threshold,
        enable_events=True,
    )


def check(cache: HiRadixCache) -> None:
    holders: dict[int, int] = {}
    cache.check_integrity(holders)
    cache.pool.check_integrity(holders)


def put(cache: HiRadixCache, tokens: list[int]):
    """Cache ``tokens`` on fresh device pages (as a finished request does)."""
    pages = cache.pool.alloc(len(tokens))
    assert pages is not None
    result = cache.insert(tokens, pages)
    cache.pool.release(result.dup_pages)  # the cache had those already
    return result.node


def plan(cache: HiRadixCache, step: int):
    """What a plan built now carries: (write-backs, loads)."""
    cache.plan_writes()
    return cache.transfers.take(step)


def events(cache: HiRadixCache) -> list[tuple[str, Medium, int]]:
    out = []
    for e in cache.take_events():
        if isinstance(e, BlockStored | BlockRemoved):
            out.append((type(e).__name__, e.medium, len(e.block_hashes)))
    return out


# ------------------------------------------------------------ write policies
def test_write_through_copies_a_node_on_the_plan_after_it_entered():
    cache = tiered(hits=1)
    node = put(cache, [1, 2, 3, 4])
    device = id_array(node.pages)
    cache.take_events()
    writes, loads = plan(cache, 1)
    assert loads is None and list(writes.src) == list(device)
    assert list(writes.dst) == list(node.host) and node.host_ref == 1
    assert events(cache) == [("BlockStored", Medium.HOST, 4)]
    # Not locked on the device: the worker reads the copy before any later write.
    assert node.lock_ref == 0 and cache.evictable_pages == 4
    check(cache)
    cache.answered(1)
    assert node.host_ref == 0
    check(cache)
    assert plan(cache, 2) == (None, None)  # copied once


def test_write_through_selective_copies_after_n_hits():
    cache = tiered(hits=3)
    node = put(cache, [1, 2, 3, 4])  # hit 1
    assert plan(cache, 1) == (None, None)
    cache.match([1, 2, 3, 4])  # hit 2
    assert plan(cache, 2) == (None, None)
    cache.match([1, 2, 3, 4, 9])  # hit 3
    writes, _ = plan(cache, 3)
    assert writes is not None and len(writes) == 4 and node.host is not None
    check(cache)


def test_write_back_copies_only_as_the_device_evicts():
    cache = tiered(hits=None)
    node = put(cache, [1, 2, 3, 4])
    cache.match([1, 2, 3, 4])
    assert plan(cache, 1) == (None, None)
    device = list(node.pages)
    cache.take_events()
    assert cache.evict(4) == 4
    writes, _ = cache.transfers.take(2)
    # Written back from its device pages, which are free again at once (the
    # worker reads write-backs before the same plan's loads and forward).
    assert list(writes.src) == device and cache.pool.num_free == 16
    assert node.pages is None and list(node.host) == list(writes.dst)
    assert events(cache) == [("BlockStored", Medium.HOST, 4), ("BlockRemoved", Medium.DEVICE, 4)]
    check(cache)


def test_device_eviction_keeps_a_host_copy_and_drops_an_uncopied_subtree():
    cache = tiered(hits=2)
    a = put(cache, [1, 2, 3, 4])
    cache.match([1, 2, 3, 4])  # hit 2: copied
    plan(cache, 1)
    cache.answered(1)
    b = put(cache, [1, 2, 3, 4, 5, 6])  # below a, hit once: no copy
    assert b.parent is a and b.host is None
    cache.take_events()
    assert cache.evict(2) == 2  # b: no host copy, dropped
    assert b.parent is None and not a.children
    assert cache.evict(4) == 4  # a: host-only now
    assert a.pages is None and a.host is not None and a.parent is not None
    assert plan(cache, 2) == (None, None)  # nothing written again
    assert events(cache) == [
        ("BlockRemoved", Medium.DEVICE, 2),
        ("BlockRemoved", Medium.DEVICE, 4),
    ]
    check(cache)


# ----------------------------------------------------- match and load back
def test_match_reports_the_host_part_and_load_back_brings_it_to_the_device():
    cache = tiered(hits=1)
    a = put(cache, [1, 2, 3, 4])
    b = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    plan(cache, 1)
    cache.answered(1)
    assert cache.evict(8) == 8 and a.pages is None and b.pages is None
    cache.take_events()
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (m.length, m.host_len, m.node.parent, m.host_node) == (0, 8, None, b)
    cache.lock(m.node) if m.node.parent is not None else None
    device = cache.load_back(m.host_node, m.node)
    writes, loads = cache.transfers.take(2)
    assert writes is None and list(loads.src) == list(a.host) + list(b.host)
    assert list(loads.dst) == list(device) == list(a.pages) + list(b.pages)
    # Locked until the plan carrying the load is answered; the host copies stay.
    assert b.lock_ref == 1 and a.host_ref == b.host_ref == 1
    assert cache.protected_pages == 8 and cache.evictable_pages == 0
    assert events(cache) == [("BlockStored", Medium.DEVICE, 4), ("BlockStored", Medium.DEVICE, 4)]
    check(cache)
    cache.answered(2)
    assert b.lock_ref == 0 and a.host_ref == b.host_ref == 0 and cache.evictable_pages == 8
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.length, m.host_len) == (8, 0)
    check(cache)


def test_a_load_the_device_cannot_hold_changes_nothing():
    cache = tiered(hits=1, device=8)
    host_only = put(cache, [1, 2, 3, 4, 5, 6])
    plan(cache, 1)
    cache.answered(1)
    cache.evict(6)
    busy = put(cache, [9, 9, 9, 9, 9, 9, 9, 9][:4])
    cache.lock(busy)
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert cache.load_back(m.host_node, m.node) is None
    assert host_only.pages is None and host_only.host_ref == 0
    assert cache.transfers.take(2) == (None, None)
    check(cache)


def test_insert_over_a_host_only_node_takes_the_callers_pages():
    cache = tiered(hits=1)
    node = put(cache, [1, 2, 3, 4])
    plan(cache, 1)
    cache.answered(1)
    cache.evict(4)
    cache.take_events()
    mine = cache.pool.alloc(4)
    result = cache.insert([1, 2, 3, 4, 5], [*mine, cache.pool.alloc(1)[0]])
    assert result.prefix_len == 0 and not result.dup_pages  # the cache took them all
    assert list(node.pages) == list(mine) and node.host is not None
    assert ("BlockStored", Medium.DEVICE, 4) in events(cache)
    check(cache)


# ------------------------------------------------------------- host LRU
def test_host_eviction_drops_host_only_leaves_least_recently_used_first():
    cache = tiered(hits=1, device=16, host=8)
    old = put(cache, [1, 2, 3, 4])
    new = put(cache, [5, 6, 7, 8])
    plan(cache, 1)
    cache.answered(1)
    cache.evict(8)  # both host-only; the host pool is full
    cache.match([5, 6, 7, 8])  # new is used again
    third = put(cache, [20, 21, 22, 23])
    writes, _ = plan(cache, 2)  # its copy needs room: the older leaf goes
    assert writes is not None and third.host is not None
    assert old.parent is None and new.parent is not None and new.host is not None
    check(cache)


def test_host_eviction_spares_a_node_under_a_copy_and_nodes_on_the_device():
    cache = tiered(hits=None, device=8, host=4)
    a = put(cache, [1, 2, 3, 4])
    cache.evict(4)  # written back: its copy is in flight on the plan being built
    b = put(cache, [5, 6, 7, 8])
    assert cache.evict(4) == 4  # b cannot be written back (a is held): dropped
    assert a.parent is not None and a.host_ref == 1 and b.parent is None
    cache.transfers.take(1)
    cache.answered(1)
    assert cache.evict_host(4) == 4 and a.parent is None
    check(cache)


def test_a_split_while_a_copy_is_in_flight_holds_both_halves():
    cache = tiered(hits=1)
    node = put(cache, [1, 2, 3, 4])
    plan(cache, 1)
    cache.evict(4)
    m = cache.match([1, 2, 9])  # splits the host-only node after 2 tokens
    upper = m.host_node
    assert upper is node.parent and upper.host_ref == node.host_ref == 1
    check(cache)
    cache.answered(1)
    assert upper.host_ref == node.host_ref == 0
    check(cache)


def test_reset_forgets_both_tiers_and_every_copy_in_flight():
    cache = tiered(hits=1)
    put(cache, [1, 2, 3, 4])
    plan(cache, 1)
    cache.evict(4)
    m = cache.match([1, 2, 3, 4])
    cache.load_back(m.host_node, m.node)
    cache.transfers.take(2)
    cache.pool.reset()  # the scheduler resets the device pool beside the cache
    cache.reset()
    assert cache.host_pool.num_free == 32 and cache.cached_pages == 0
    assert cache.transfers.held() == ({}, 0) and not cache.transfers.pending
    cache.answered(1)  # a stale answer is ignored: its record went with the tree
    check(cache)


# ------------------------------------------------------------ the scheduler
V = 300


def req(rid: str, prompt: list[int], max_new: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def cfg(**kw) -> SchedulerConfig:
    kw.setdefault("vocab_size", V)
    kw.setdefault("page_size", 4)
    return SchedulerConfig(**kw)


def test_the_tier_off_is_the_plain_cache_and_plans_carry_no_copies():
    config = cfg()
    sched, worker = make_pair(config, 32, V)
    assert sched.hicache is None and type(sched.cache) is RadixCache
    reqs = [req(f"r{i}", list(range(1, 30))) for i in range(3)]
    sched.add_request(reqs[0])
    while (p := sched.step()) is not None:
        assert p.write_backs is None and p.loads is None
        sched.update(worker.execute(p))


def test_a_prefix_evicted_to_the_host_is_loaded_back_by_admission():
    config = cfg(hicache_host_pages=64, hicache_write_policy="write_back")
    sched, worker = make_pair(config, 16, V)
    system = list(range(1, 33))  # 8 pages: half the device pool
    first = req("first", system + [40, 41])
    other = req("other", list(range(100, 140)), max_new=2)  # evicts the system prompt
    again = req("again", system + [50, 51, 52])
    log = drive(sched, worker, [(0, first), (8, other), (16, again)])
    check_outputs([first, other, again], config, V, log)
    check_drained(sched, worker)
    tier = sched.hicache
    assert tier.transfers.written_pages >= 8 and tier.transfers.loaded_pages == 8
    assert again.cached_tokens == 32  # read from the cache, by way of the host
    assert sched.stats.cached_tokens == 32


def test_a_host_hit_below_the_load_back_threshold_is_computed():
    config = cfg(
        hicache_host_pages=64, hicache_write_policy="write_back", hicache_load_back_threshold=64
    )
    sched, worker = make_pair(config, 16, V)
    system = list(range(1, 33))
    first = req("first", system + [40, 41])
    other = req("other", list(range(100, 140)), max_new=2)
    again = req("again", system + [50, 51, 52])
    log = drive(sched, worker, [(0, first), (8, other), (16, again)])
    check_outputs([first, other, again], config, V, log)
    check_drained(sched, worker)
    assert sched.hicache.transfers.loaded_pages == 0 and again.cached_tokens == 0


def test_plans_carry_the_copies_and_the_answer_gives_back_the_locks():
    config = cfg(hicache_host_pages=64, hicache_write_policy="write_through")
    sched, worker = make_pair(config, 16, V)
    system = list(range(1, 33))
    for rid, at in (("a", 0), ("b", 40)):
        sched.add_request(req(rid, system + [60 + at % 7], max_new=1))
        carried = []
        for _ in range(30):
            p = sched.step()
            if p is None:
                break
            carried.append((p.write_backs is not None, p.loads is not None))
            sched.check_integrity()
            sched.update(worker.execute(p))
            sched.check_integrity()
        if rid == "a":
            assert (True, False) in carried  # written through on a later plan
            sched.add_request(req("filler", list(range(100, 152)), max_new=1))
            while (p := sched.step()) is not None:
                sched.update(worker.execute(p))
        else:
            assert (False, True) in carried  # the system prompt came back from the host
    assert sched.cache.transfer_locks == 0 and sched.cache.protected_pages == 0


# ---------------------------------------------------------------- admission
def adder_with_host_hit(device: int, held: int, **config_kw):
    """A PrefillAdder over a tiered cache holding tokens 1..8 host-only, with
    ``held`` device pages taken by someone else, and the waiting request
    [1..8, 9..12] matched against it."""
    config = SchedulerConfig(
        page_size=1, hicache_host_pages=32, hicache_load_back_threshold=0, **config_kw
    )
    cache = tiered(hits=1, device=device)
    put(cache, list(range(1, 9)))
    plan(cache, 1)
    cache.answered(1)
    cache.evict(8)
    assert cache.pool.alloc(held) is not None
    kv = KvManager(cache.pool, cache)
    r = Request("r", list(range(1, 13)), SamplingParams(max_new_tokens=1))
    match_prefix(cache, r)
    assert (r.match_len, r.match_host_len) == (0, 8)
    return PrefillAdder(config, kv, [], new_token_ratio=0.5), kv, r


def test_the_adder_loads_a_host_hit_that_fits_and_counts_its_pages():
    adder, kv, r = adder_with_host_hit(device=32, held=2)
    assert adder.add_one_req(r) is AddResult.CONTINUE
    assert adder.admitted == [(r, 12)] and r.kv_len == 8 and r.tree_pages == 8
    _, loads = kv.cache.transfers.take(1)
    assert loads is not None and list(loads.dst) == list(r.pages)
    # The loaded pages were taken at once: 32 - 2 held - 8 loaded.
    assert kv.pool.num_free == 22 and kv.cache.protected_pages == 8
    assert adder.rem_input_tokens == adder.config.max_prefill_tokens - 4  # only 4 computed


def test_the_adder_declines_a_load_it_cannot_hold_and_computes_instead():
    adder, kv, r = adder_with_host_hit(device=16, held=9, chunked_prefill_size=4)
    adder.add_one_req(r)  # 7 pages free: no room for the 8-page hit
    assert kv.cache.transfers.take(1) == (None, None)
    assert adder.admitted == [(r, 4)] and r.kv_len == 0  # a first chunk from 0


def test_the_adder_plans_no_load_for_a_request_it_does_not_admit():
    adder, kv, r = adder_with_host_hit(device=16, held=5, chunked_prefill_size=None)
    # 11 free: the load fits, the whole prompt (8 loaded + 4) does not.
    assert adder.add_one_req(r) is AddResult.NO_TOKEN and not adder.admitted
    assert kv.cache.transfers.take(1) == (None, None)
    assert kv.pool.num_free == 11 and kv.cache.protected_pages == 0


def test_insert_over_an_unlocked_node_with_other_pages_swaps_them():
    cache = tiered(hits=None)
    node = put(cache, [1, 2, 3, 4])
    theirs = list(node.pages)
    mine = cache.pool.alloc(4)
    result = cache.insert([1, 2, 3, 4], mine)
    # The node now holds the caller's copies and its own are free: nobody
    # pins both (a locked node keeps its pages, the caller's are duplicates).
    assert list(node.pages) == list(mine) and not result.dup_pages and result.prefix_len == 0
    assert all(cache.pool.refcount(p) == 0 for p in theirs)
    check(cache)
    cache.lock(node)
    again = cache.pool.alloc(4)
    result = cache.insert([1, 2, 3, 4], again)
    assert list(result.dup_pages) == list(again) and result.prefix_len == 4
    cache.pool.release(result.dup_pages)
    check(cache)
