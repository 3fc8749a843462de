"""Scheduler behaviour in hand-made situations (the property tests cover the rest)."""

from __future__ import annotations

import pytest

from scheduler_service.core import (
    FinishAbort,
    FinishLength,
    FinishStop,
    ForwardMode,
    InvalidRequestError,
    LogprobOptions,
    Place,
    ProtocolError,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from scheduler_service.core.decode import retraction_order
from scheduler_service.core.kv.events import BlockStored
from scheduler_service.testing.simulated_worker import expected_output
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
    toy_stop_strings,
)

V = 64


def cfg(**kw) -> SchedulerConfig:
    kw.setdefault("vocab_size", V)
    return SchedulerConfig(**kw)


def req(rid, prompt, max_new=8, **sp) -> Request:
    extra = {k: sp.pop(k) for k in ("priority", "extra_key", "logprobs") if k in sp}
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new, **sp), **extra)


def run(config, num_pages, reqs, overlap=False, aborts=None, arrivals=None):
    sched, worker = make_pair(config, num_pages, V)
    arrivals = arrivals or [(0, r) for r in reqs]
    log = drive(sched, worker, arrivals, aborts, overlap=overlap)
    check_outputs(reqs, config, V, log, allow_abort={r.rid for r in reqs if aborts})
    check_drained(sched, worker)
    return sched, worker, log


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_outputs_match_the_oracle_at_any_overlap_depth(lag):
    reqs = [req(f"r{i}", range(i + 1, i + 20), max_new=12 + i) for i in range(6)]
    sched, _, _ = run(cfg(page_size=4, max_running_requests=3), 64, reqs, overlap=lag)
    assert sched.stats.finished == {"length": 6}


def test_a_request_found_finished_late_drops_its_extra_token_and_page():
    prompt = list(range(1, 9))
    third = expected_output(prompt, 3, V)[2]
    r = req("r", prompt, max_new=20, stop_token_ids=frozenset({third}))
    sched, _, _ = run(cfg(), 64, [r], overlap=True)
    assert r.output_ids == expected_output(prompt, 3, V) and r.finish_reason == FinishStop(third)
    assert sched.stats.discarded_tokens == 1
    # The cache holds prompt + output, the last token's KV included (the
    # extra step computed it); the page of the discarded token was freed.
    assert sched.cache.match(prompt + r.output_ids + [0]).length == 11
    assert sched.pool.num_free == 64 - 11


def test_retraction_order_is_least_progress_then_longest_prompt():
    def r(rid, n_prompt, n_out):
        x = req(rid, range(1, n_prompt + 1))
        x.output_ids = [1] * n_out
        return x

    reqs = [r("short-few", 5, 2), r("many", 5, 9), r("long-few", 50, 2), r("mid", 5, 4)]
    order = [x.rid for x in retraction_order(reqs)]
    assert order[::-1] == ["long-few", "short-few", "mid", "many"]  # popped from the end


def test_retraction_frees_memory_and_outputs_continue_unchanged():
    reqs = [req(f"r{i}", range(10 * i + 1, 10 * i + 11), 30) for i in range(4)]
    config = cfg(init_new_token_ratio=0.01, chunked_prefill_size=None)
    sched, worker = make_pair(config, 60, V)
    for r in reqs:
        sched.add_request(r)
    ratios = []
    while not sched.stats.retractions:
        before = {
            r.rid: (len(r.output_ids), -len(r.prompt_ids)) for r in sched.table.running.values()
        }
        plan = sched.step()
        sched.update(worker.execute(plan))
        sched.check_integrity()
        ratios.append(sched.new_token_ratio)
    retracted = [r for r in reqs if r.retractions]
    assert len(retracted) == 1 and retracted[0].place is Place.WAITING
    assert before[retracted[0].rid] == min(before.values())
    assert not retracted[0].pages and retracted[0].output_ids  # keeps what it generated
    assert ratios[-1] > ratios[-2]  # raised by the retraction
    sched.update(worker.execute(sched.step()))
    assert sched.new_token_ratio < ratios[-1]  # and decaying again
    drive(sched, worker, [])
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 30, V)
    check_drained(sched, worker)


def test_abort_frees_pages_at_once_and_tells_the_worker():
    config = cfg()
    sched, worker = make_pair(config, 64, V)
    r = req("r", range(1, 20), max_new=50)
    sched.add_request(r)
    for _ in range(5):
        sched.update(worker.execute(sched.step()))
    held = sched.pool.num_used - sched.cache.evictable_pages
    assert held > 0
    assert sched.abort("r")
    assert sched.pool.num_used == sched.cache.evictable_pages  # nothing held any more
    (delta,) = [d for d in sched.drain() if d.finished]
    assert isinstance(delta.req.finish_reason, FinishAbort)
    plan = sched.step()
    assert plan.mode is ForwardMode.IDLE and plan.leaves == ["r"]
    sched.update(worker.execute(plan))
    assert not worker.reqs and not sched.abort("r")
    check_drained(sched, worker)


def test_a_chunked_request_is_first_in_line_next_step():
    config = cfg(page_size=4, chunked_prefill_size=16, schedule_policy="lof")
    sched, worker = make_pair(config, 64, V)
    long = req("long", range(1, 41), max_new=2)
    sched.add_request(long)
    plan = sched.step()
    assert [(e.rid, e.start_pos, len(e.input_ids), e.sample) for e in plan.entries] == [
        ("long", 0, 16, False)
    ]
    sched.update(worker.execute(plan))
    sched.add_request(req("urgent", range(50, 54), max_new=100))  # lof would put it first
    plan = sched.step()
    assert plan.entries[0].rid == "long" and plan.entries[0].start_pos == 16
    sched.update(worker.execute(plan))
    log = drive(sched, worker, [])
    assert log.steps > 0
    check_drained(sched, worker)


def test_mixed_steps_decode_while_prefilling():
    config = cfg(enable_mixed_chunk=True, chunked_prefill_size=8)
    sched, worker = make_pair(config, 128, V)
    a = req("a", range(1, 5), max_new=30)
    sched.add_request(a)
    sched.update(worker.execute(sched.step()))
    sched.add_request(req("b", range(10, 30), max_new=4))
    plan = sched.step()
    assert plan.mode is ForwardMode.MIXED
    assert [(e.rid, e.input_ids is None) for e in plan.entries] == [("b", False), ("a", True)]
    sched.update(worker.execute(plan))
    log = drive(sched, worker, [])
    check_outputs([a], config, V, log)


def test_stop_strings_go_through_the_checker():
    prompt = list(range(1, 6))
    exp = expected_output(prompt, 10, V)
    stop = f"<{exp[3]}>"

    config = cfg()
    sched, worker = make_pair(config, 64, V, stop_strings=toy_stop_strings)
    r = req("r", prompt, max_new=10, stop_strs=(stop,))
    sched.add_request(r)
    drive(sched, worker, [])
    assert r.finish_reason == FinishStop(stop)
    assert r.output_ids == exp[: exp.index(exp[3]) + 1]


def test_min_new_tokens_and_ignore_eos():
    prompt = list(range(1, 6))
    exp = expected_output(prompt, 40, V)
    eos = exp[1]
    config = cfg(eos_token_ids=frozenset({eos}))
    early = req("early", prompt, max_new=40)
    held = req("held", prompt, max_new=40, min_new_tokens=2)
    ignoring = req("ignoring", prompt, max_new=40, ignore_eos=True)
    run(config, 256, [early, held, ignoring])
    assert early.output_ids == exp[:2] and early.finish_reason == FinishStop(eos)
    assert len(held.output_ids) > 2  # EOS at token 2 did not count
    assert ignoring.output_ids == exp and ignoring.finish_reason == FinishLength(40)


def test_zero_max_new_tokens_prefills_into_the_cache():
    prompt = list(range(1, 33))
    warm = req("warm", prompt, max_new=0)
    sched, _, _ = run(cfg(page_size=4), 64, [warm])
    assert warm.output_ids == [] and warm.finish_reason == FinishLength(0)
    assert sched.cache.match(prompt).length == 32
    hit = req("hit", prompt + [40, 41], max_new=2)
    sched2, worker = make_pair(cfg(page_size=4), 64, V)
    drive(sched2, worker, [(0, warm2 := req("w2", prompt, max_new=0)), (1, hit)])
    assert warm2.finished and hit.cached_tokens == 32


def test_prompt_logprob_positions_are_computed_not_cached():
    config = cfg(chunked_prefill_size=4)
    sched, worker = make_pair(config, 64, V)
    drive(sched, worker, [(0, req("warm", range(1, 13), max_new=1))])
    lp = LogprobOptions(return_logprob=True, logprob_start_len=5)
    r = req("lp", range(1, 13), max_new=1, logprobs=lp)
    sched.add_request(r)
    plan = sched.step()
    (entry,) = plan.entries
    (join,) = plan.joins
    # Token 5 is scored by the logits at position 4, so 4 tokens come from the cache.
    assert entry.start_pos == 4 and join.prefix_ids == [1, 2, 3, 4]
    assert entry.next_token == 9  # the prompt token after this chunk, to score it
    result = worker.execute(plan)
    result.outputs[0].prompt_logprobs = []
    sched.update(result)
    drive(sched, worker, [])
    assert r.finished and r.cached_tokens == 4


def test_prompt_logprobs_reach_the_client_once():
    lp = LogprobOptions(return_logprob=True, logprob_start_len=0)
    sched = Scheduler(cfg(chunked_prefill_size=None), 64)
    r = req("r", range(1, 5), max_new=1, logprobs=lp)
    sched.add_request(r)
    plan = sched.step()
    from scheduler_service.core import TokenLogprobs

    out = RequestOutput("r", 7, prompt_logprobs=[TokenLogprobs(-1.0)] * 4)
    sched.update(StepResult(plan.step_id, [out]))
    (delta,) = sched.drain()
    assert delta.prompt_logprobs_start == 0 and len(delta.prompt_logprobs) == 4
    assert not r.prompt_logprobs_pending and delta.finished


def test_results_that_do_not_fit_the_plan_are_refused():
    sched = Scheduler(cfg(), 64)
    sched.add_request(req("r", range(1, 5)))
    plan = sched.step()
    with pytest.raises(ProtocolError, match="expected step"):
        sched.update(StepResult(plan.step_id + 1, []))
    with pytest.raises(ProtocolError, match="sampled tokens"):
        sched.update(StepResult(plan.step_id, []))
    sched2 = Scheduler(cfg(), 64)
    sched2.add_request(req("r", range(1, 5)))
    plan = sched2.step()
    with pytest.raises(ProtocolError, match="no entry"):
        sched2.update(StepResult(plan.step_id, [RequestOutput("ghost", 1)]))
    sched3 = Scheduler(cfg(), 64)
    sched3.add_request(req("r", range(1, 5)))
    plan = sched3.step()
    twice = [RequestOutput("r", 1), RequestOutput("r", token_id=None)]  # one entry, two outputs
    with pytest.raises(ProtocolError, match="no entry"):
        sched3.update(StepResult(plan.step_id, twice))


def test_bad_requests_are_refused_with_reasons():
    sched = Scheduler(cfg(context_len=100), 16)
    sched.add_request(req("r", [1, 2]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(req("r", [1, 2]))
    with pytest.raises(InvalidRequestError, match="holds 16 tokens"):
        sched.add_request(req("big", range(1, 17), max_new=1))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        sched.add_request(req("oov", [V]))
    with pytest.raises(InvalidRequestError, match="context length"):
        sched.add_request(req("ctx", [1] * 10, max_new=95))
    assert sched.live_rids() == ["r"]


def test_priority_preempts_and_the_preempted_request_resumes():
    config = cfg(max_running_requests=1, enable_priority_scheduling=True)
    low = req("low", range(1, 10), max_new=30, priority=0)
    high = req("high", range(20, 30), max_new=5, priority=50)
    sched, _, _ = run(config, 128, [low, high], arrivals=[(0, low), (5, high)])
    assert low.preemptions == 1 and sched.stats.preemptions == 1
    assert high.times.finished < low.times.finished


def test_single_request_that_outgrows_the_pool_is_aborted():
    config = cfg()
    r = req("r", range(1, 10), max_new=40)
    sched, worker = make_pair(config, 20, V)
    log = drive(sched, worker, [(0, r)])
    assert isinstance(r.finish_reason, FinishAbort) and "out of memory" in r.finish_reason.message
    assert r.output_ids == expected_output(r.prompt_ids, 40, V)[: len(r.output_ids)]
    assert log.finished_deltas == {"r": 1} and sched.stats.oom_aborts == 1
    check_drained(sched, worker)


def test_kv_events_and_cache_hits_across_requests():
    config = cfg(page_size=4, enable_kv_events=True)
    shared = list(range(1, 17))
    first, second = req("a", shared + [30], max_new=3), req("b", shared + [31], max_new=3)
    sched, _, _ = run(config, 64, [first, second], arrivals=[(0, first), (20, second)])
    assert second.cached_tokens == 16
    stored = [e for e in sched.cache.take_events() if isinstance(e, BlockStored)]
    assert stored and stored[0].token_ids[:16] == shared


def test_extra_keys_keep_caches_apart():
    shared = list(range(1, 17))
    a = req("a", shared + [30], max_new=2, extra_key="A")
    b = req("b", shared + [31], max_new=2, extra_key="B")
    run(cfg(), 64, [a, b], arrivals=[(0, a), (20, b)])
    assert b.cached_tokens == 0


def test_new_token_ratio_decays_per_decode_step_and_resets_when_idle():
    config = cfg()
    sched, worker = make_pair(config, 64, V)
    sched.add_request(req("r", range(1, 4), max_new=5))
    start = sched.new_token_ratio
    sched.update(worker.execute(sched.step()))  # prefill
    sched.update(worker.execute(sched.step()))  # decode
    assert sched.new_token_ratio == pytest.approx(start - config.new_token_ratio_decay)
    drive(sched, worker, [])
    sched.step()
    assert sched.new_token_ratio == start


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_requests_sharing_an_uncached_prefix_wait_a_step_and_read_it_from_the_cache(lag):
    shared = [t % 60 + 1 for t in range(64)]
    reqs = [req(f"r{i}", shared + [i + 1] * 8, max_new=4) for i in range(4)]
    sched, _, _ = run(cfg(page_size=4), 256, reqs, overlap=lag)
    # The first computes the 64 shared tokens; the others wait one step and
    # find them cached, whatever the overlap depth (prefixes are cached when
    # planned, and the worker runs plans in order).
    assert sorted(r.cached_tokens for r in reqs) == [0, 64, 64, 64]
    assert sched.stats.cached_tokens == 3 * 64

    reqs = [req(f"s{i}", shared + [i + 1] * 8, max_new=4) for i in range(4)]
    sched, _, _ = run(cfg(page_size=4, prefix_hold_tokens=0), 256, reqs, overlap=lag)
    assert [r.cached_tokens for r in reqs] == [0, 0, 0, 0]  # all admitted at once


def test_a_short_shared_prefix_is_not_worth_a_wait():
    shared = list(range(1, 17))  # 16 < the default 32 tokens
    reqs = [req(f"r{i}", shared + [i + 1] * 8, max_new=4) for i in range(3)]
    run(cfg(page_size=4), 256, reqs)
    assert [r.cached_tokens for r in reqs] == [0, 0, 0]
    with pytest.raises(ValueError, match="prefix_hold_tokens"):
        cfg(prefix_hold_tokens=-1)


@pytest.mark.parametrize("lag", [0, 2])
def test_siblings_wait_for_the_leaders_prefill_and_read_the_prompt_from_the_cache(lag):
    prompt = list(range(1, 41))
    leader = req("n-0", prompt, max_new=6)
    siblings = [req(f"n-{i}", prompt, max_new=6) for i in (1, 2)]
    for s in siblings:
        s.waits_for = "n-0"
    sched, worker = make_pair(cfg(page_size=4), 64, V)
    for r in (leader, *siblings):
        sched.add_request(r)
    assert sched.table.held == siblings and sched.table.waiting == [leader]
    sched.check_integrity()  # held requests are placed, and nowhere else
    plan = sched.step()
    assert [j.rid for j in plan.joins] == ["n-0"]  # the siblings are still held
    sched.check_integrity()
    sched.update(worker.execute(plan))
    first = sched.drain()
    log = drive(sched, worker, [], overlap=lag)
    log.deltas["n-0"][:0] = first[0].new_token_ids
    check_outputs([leader, *siblings], sched.config, V, log)
    check_drained(sched, worker)
    # Each sibling computed only the prompt's last (uncachable) page.
    assert [s.cached_tokens for s in siblings] == [36, 36]
    assert not sched.table.held


def test_an_aborted_held_sibling_finishes_and_a_leaders_abort_releases_the_rest():
    prompt = list(range(1, 21))
    leader, sib, other = req("n-0", prompt), req("n-1", prompt), req("n-2", prompt)
    sib.waits_for = other.waits_for = "n-0"
    sched, worker = make_pair(cfg(page_size=4), 64, V)
    for r in (leader, sib, other):
        sched.add_request(r)
    assert sched.abort("n-1", "client gone")
    assert sched.table.held == [other] and isinstance(sib.finish_reason, FinishAbort)
    (gone,) = sched.drain()
    assert gone.req is sib and gone.finished
    sched.check_integrity()
    sched.abort("n-0")  # the leader never ran: its sibling is free to prefill itself
    log = drive(sched, worker, [])
    assert not sched.table.held and other.finished and other.cached_tokens == 0
    check_outputs([other], sched.config, V, log)
    check_drained(sched, worker)


@pytest.mark.parametrize("lag", [0, 1])
def test_prefill_only_scoring_with_token_ids_logprob_gets_a_next_token_row_and_no_token(lag):
    """max_new_tokens 0 with token_ids_logprob: the last chunk samples so the
    worker computes the requested ids' logprobs after the prompt; the core
    keeps no token and hands the row on (the public proto promises it). A
    scoring request that asked for no ids samples nothing, as before."""
    ids = LogprobOptions(return_logprob=True, token_ids_logprob=(3, 5))
    scored = req("scored", range(1, 11), max_new=0, logprobs=ids)
    plain = req("plain", range(2, 12), max_new=0, logprobs=LogprobOptions(return_logprob=True))
    sched, worker = make_pair(cfg(page_size=4, chunked_prefill_size=8), 64, V)
    sched.add_request(scored)
    sched.add_request(plain)
    rows: dict[str, list] = {"scored": [], "plain": []}
    sampled: set[str] = set()
    inflight = []
    for _ in range(20):
        plan = sched.step()
        if plan is not None:
            sampled |= {e.req.rid for e in plan.extends if e.sample}
            inflight.append(plan)
        while inflight and (len(inflight) > lag or plan is None):
            sched.update(worker.execute(inflight.pop(0)))
            sched.check_integrity()
        for d in sched.drain():
            assert d.new_token_ids == []
            if d.next_token_logprobs is not None:
                rows[d.req.rid].append(d.next_token_logprobs)
        if sched.is_idle() and not inflight:
            break
    assert sampled == {"scored"}
    assert len(rows["scored"]) == 1 and rows["plain"] == []
    for r in (scored, plain):
        assert r.output_ids == [] and r.finish_reason == FinishLength(0)
    check_drained(sched, worker)
