from __future__ import annotations

import pytest

from scheduler_service.core.admission.adder import AddResult, PrefillAdder
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import Place, Request
from scheduler_service.core.sampling import SamplingParams


def setup(num_pages=100, page_size=1, **cfg):
    config = SchedulerConfig(page_size=page_size, **cfg)
    pool = PagePool(num_pages, page_size)
    return config, KvManager(pool, RadixCache(page_size, pool))


def waiting(kv, rid, n_prompt, max_new=16, priority=0, t=0.0):
    r = Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_new_tokens=max_new))
    r.priority = priority
    r.times.queue_entry = t
    m = kv.cache.match(r.prompt_ids, limit=r.max_prefix_len())
    r.match_pages, r.match_len, r.match_node = m.pages, m.length, m.node
    return r


def running(kv, rid, max_new, outputs=0, priority=0, t=0.0):
    r = Request(rid, [1], SamplingParams(max_new_tokens=max_new), priority=priority)
    r.output_ids = [5] * outputs
    r.times.queue_entry = t
    r.place = Place.RUNNING
    r.pages = kv.pool.alloc(1 + outputs)
    r.kv_len = len(r.pages)
    return r


def test_total_budget_counts_running_requests_expected_need():
    config, kv = setup(num_pages=102, chunked_prefill_size=None)
    run = [running(kv, "run", max_new=200)]  # holds 1 page; 101 available
    assert PrefillAdder(config, kv, run, new_token_ratio=0.5).rem_total_tokens == 1
    adder = PrefillAdder(config, kv, run, new_token_ratio=0.1)  # 101 - 20 = 81
    assert adder.add_one_req(waiting(kv, "a", 30, max_new=40)) is AddResult.CONTINUE
    assert adder.add_one_req(waiting(kv, "b", 30, max_new=40)) is AddResult.NO_TOKEN
    assert [r.rid for r, _ in adder.admitted] == ["a"]


def test_expected_need_is_clipped_per_request():
    config, kv = setup(num_pages=10_000)
    adder = PrefillAdder(config, kv, [running(kv, "r", max_new=1_000_000)], new_token_ratio=0.5)
    assert adder.rem_total_offset == 4096 * 0.5


def test_max_prefill_tokens_admits_the_first_request_regardless():
    config, kv = setup(num_pages=1000, chunked_prefill_size=None, max_prefill_tokens=50)
    adder = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    assert adder.add_one_req(waiting(kv, "big", 80)) is AddResult.OTHER
    assert [r.rid for r, _ in adder.admitted] == ["big"]
    config, kv = setup(num_pages=1000, chunked_prefill_size=None, max_prefill_tokens=50)
    adder = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    assert adder.add_one_req(waiting(kv, "a", 20)) is AddResult.CONTINUE
    assert adder.add_one_req(waiting(kv, "b", 40)) is AddResult.OTHER
    assert [r.rid for r, _ in adder.admitted] == ["a"]


def test_long_prompts_are_chunked_at_page_boundaries():
    config, kv = setup(num_pages=100, page_size=4, chunked_prefill_size=32)
    adder = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    req = waiting(kv, "long", 100)
    assert adder.add_one_req(req) is AddResult.OTHER  # the chunk budget is spent
    assert adder.admitted == [(req, 32)] and adder.new_chunked is req
    kv.grow(req, 32)
    req.kv_len = 32
    nxt = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    nxt.add_chunked_req(req)
    assert nxt.admitted == [(req, 64)] and nxt.new_chunked is req
    kv.grow(req, 96)
    req.kv_len = 96
    last = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    last.add_chunked_req(req)
    assert last.admitted == [(req, 100)] and last.new_chunked is None


def test_a_chunk_after_a_cached_prefix_ends_on_a_page_boundary():
    config, kv = setup(num_pages=100, page_size=4, chunked_prefill_size=30)
    pages = kv.pool.alloc(2)
    kv.cache.insert(list(range(1, 9)), pages)
    req = waiting(kv, "r", 60)
    assert req.match_len == 8
    adder = PrefillAdder(config, kv, [], new_token_ratio=0.5)
    adder.add_one_req(req)
    assert adder.admitted == [(req, 36)]  # 8 cached + 28 computed (30 cut to a page)
    assert req.pages == pages and req.tree_pages == 2 and req.last_node.lock_ref == 1


def test_an_idle_scheduler_admits_whatever_physically_fits():
    config, kv = setup(num_pages=50, chunked_prefill_size=None)
    adder = PrefillAdder(config, kv, [], new_token_ratio=1.0)
    # 40 + 4096 expected tokens do not fit the estimate, but nothing else runs.
    assert adder.add_one_req(waiting(kv, "a", 40, max_new=100_000)) is AddResult.NO_TOKEN
    assert len(adder.admitted) == 1
    assert adder.add_one_req(waiting(kv, "b", 2)) is AddResult.NO_TOKEN
    assert len(adder.admitted) == 1


def test_mixed_decode_tokens_come_out_of_the_step_budgets():
    config, kv = setup(num_pages=1000, chunked_prefill_size=64, max_prefill_tokens=100)
    adder = PrefillAdder(config, kv, [], new_token_ratio=0.5, mixed_decode_tokens=24)
    assert adder.rem_chunk_tokens == 40 and adder.rem_input_tokens == 76
    adder.add_one_req(waiting(kv, "r", 100))
    assert adder.admitted[0][1] == 40


@pytest.mark.parametrize(("gap", "preempts"), [(20, True), (10, False)])
def test_priority_preemption_needs_a_gap_past_the_threshold(gap, preempts):
    config, kv = setup(num_pages=60, enable_priority_scheduling=True)
    run = [running(kv, "low", max_new=100, priority=0, t=1.0)]
    adder = PrefillAdder(config, kv, run, new_token_ratio=1.0)
    req = waiting(kv, "high", 20, max_new=20, priority=gap)
    assert adder.add_one_req(req) is AddResult.NO_TOKEN  # 59 - 99 leaves no room
    assert run[0].pages
    assert adder.preempt_to_schedule(req, run) is preempts
    assert [r.rid for r in adder.preempted] == (["low"] if preempts else [])
    # A preempted request's KV is released at once; only the move is left to the scheduler.
    assert (len(run[0].pages) == 0) is preempts
