from __future__ import annotations

from scheduler_service.core.admission.policy import SchedulePolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import SamplingParams


def cache_with(*keys):
    pool = PagePool(4096, 1)
    cache = RadixCache(1, pool)
    for key in keys:
        m = cache.match(key)
        cache.insert(key, m.pages + pool.alloc(len(key) - m.length))
    return cache


def req(rid, prompt, t=0.0, priority=0, max_new=16, routing_key=None):
    r = Request(
        rid,
        prompt,
        SamplingParams(max_new_tokens=max_new),
        priority=priority,
        routing_key=routing_key,
    )
    r.times.queue_entry = t
    return r


def order(policy, waiting, cache=None, running=(), **cfg):
    config = SchedulerConfig(schedule_policy=policy, **cfg)
    SchedulePolicy(config, cache or cache_with()).order(waiting, list(running))
    return [r.rid for r in waiting]


SYS_A = list(range(100, 160))
SYS_B = list(range(200, 220))


def test_fcfs_keeps_arrival_order_and_priority_sorts_first():
    waiting = [req("a", [1], 0, priority=1), req("b", [1], 1, priority=5), req("c", [1], 2, 5)]
    assert order("fcfs", list(waiting)) == ["a", "b", "c"]
    assert order("fcfs", list(waiting), enable_priority_scheduling=True) == ["b", "c", "a"]
    assert order(
        "fcfs",
        list(waiting),
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
    ) == ["a", "b", "c"]


def test_lpm_puts_the_longest_cached_prefix_first():
    cache = cache_with(SYS_A, SYS_B)
    waiting = [req("none", [1, 2, 3]), req("b", SYS_B + [1]), req("a", SYS_A + [1])]
    assert order("lpm", waiting, cache) == ["a", "b", "none"]


def test_lpm_holds_back_requests_sharing_an_uncached_prefix():
    shared = list(range(500, 540))  # 40 tokens nobody has cached yet
    waiting = [
        req("first", shared + [1]),
        req("twin", shared + [2]),
        req("other", [7, 8, 9]),
        req("triplet", shared + [3]),
    ]
    # The twins of "first" wait a step so they hit the cache "first" fills.
    assert order("lpm", waiting) == ["first", "other", "twin", "triplet"]


def test_lpm_falls_back_to_fcfs_past_128_waiting():
    cache = cache_with(SYS_A)
    waiting = [req(f"r{i}", [i + 1000]) for i in range(129)] + [req("hit", SYS_A + [1])]
    assert order("lpm", waiting, cache)[-1] == "hit"
    assert order("lpm", waiting[2:], cache)[0] == "hit"  # 128 waiting: lpm again


def test_lpm_fallback_past_128_waiting_is_arrival_order():
    # (issue 19) the queue left as earlier lpm sorts made it is not fcfs
    waiting = [req(f"r{i}", [i + 1000], t=float((i * 37) % 130)) for i in range(130)]
    got = order("lpm", waiting, cache_with())
    assert got == [r.rid for r in sorted(waiting, key=lambda r: r.times.queue_entry)]


def test_lpm_ages_requests_that_waited_past_lpm_max_wait():
    cache = cache_with(SYS_A)
    waiting = [
        req("hit", SYS_A + [1], t=9.5),
        req("old", [7, 8, 9], t=5.0),
        req("older", [4, 5, 6], t=2.0),
        req("young", [1, 2, 3], t=9.8),
    ]
    config = SchedulerConfig(schedule_policy="lpm", lpm_max_wait_s=3.0)
    SchedulePolicy(config, cache).order(waiting, [], now=10.0)
    # waited >= 3 s: oldest first, ahead of the prefix match; then lpm's order
    assert [r.rid for r in waiting] == ["older", "old", "hit", "young"]
    config = SchedulerConfig(schedule_policy="lpm", lpm_max_wait_s=0.0)  # off
    SchedulePolicy(config, cache).order(waiting, [], now=10.0)
    assert waiting[0].rid == "hit"


def test_dfs_weight_groups_requests_under_the_heaviest_subtree_first():
    cache = cache_with(SYS_A, SYS_B)
    waiting = [
        req("b1", SYS_B + [1]),
        req("a1", SYS_A + [1]),
        req("x", [9, 9]),
        req("a2", SYS_A + [2]),
        req("b2", SYS_B + [2]),
        req("a3", SYS_A + [3]),
    ]
    got = order("dfs-weight", waiting, cache)
    assert got[:3] == ["a1", "a2", "a3"] and got[3:5] == ["b1", "b2"] and got[5] == "x"


def test_lof_sorts_by_max_new_tokens():
    waiting = [req("s", [1], max_new=4), req("l", [1], max_new=400), req("m", [1], max_new=40)]
    assert order("lof", waiting) == ["l", "m", "s"]
    waiting = [req("s", [1], max_new=4, priority=9), req("l", [1], max_new=400)]
    assert order("lof", waiting, enable_priority_scheduling=True) == ["s", "l"]


def test_random_is_a_seeded_permutation():
    make = lambda: [req(str(i), [1]) for i in range(20)]  # noqa: E731
    first = order("random", make(), random_seed=3)
    assert sorted(first, key=int) == [str(i) for i in range(20)]
    assert first == order("random", make(), random_seed=3)
    assert first != [str(i) for i in range(20)]


def test_routing_key_prefers_keys_common_in_the_running_batch():
    running = [req("r1", [1], routing_key="k1"), req("r2", [1], routing_key="k2")]
    running.append(req("r3", [1], routing_key="k2"))
    waiting = [
        req("none", [1]),
        req("k1", [1], routing_key="k1"),
        req("k3", [1], routing_key="k3"),
        req("k2", [1], routing_key="k2"),
    ]
    assert order("routing-key", waiting, running=running) == ["k2", "k1", "none", "k3"]
