"""cached_tokens counts the prompt tokens a request read from the prefix
cache, once: a retracted request that reads back what it computed itself
counts nothing more (SGLang's rule), and after a worker loss (the cache
dropped) nothing it read before counts, since all of it is recomputed. The
core's hit rate (stats.cached_tokens) is the sum of the requests' counts."""

from __future__ import annotations

from scheduler_service.core import LogprobOptions, Request, SamplingParams, SchedulerConfig
from scheduler_service.testing.simulated_worker import SimulatedWorker
from tests.scheduler_service.core.support.sim_driver import check_drained, drive, make_pair

V = 64


def req(rid: str, prompt, max_new: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def test_a_retracted_request_does_not_count_its_own_tokens_as_cached():
    # four 10-token prompts with nothing in common, 30 tokens each to come:
    # the 60-page pool cannot hold them all, so one is retracted and
    # re-prefills its prompt and output from the cache it filled itself
    reqs = [req(f"r{i}", range(10 * i + 1, 10 * i + 11), 30) for i in range(4)]
    config = SchedulerConfig(vocab_size=V, init_new_token_ratio=0.01, chunked_prefill_size=None)
    sched, worker = make_pair(config, 60, V)
    drive(sched, worker, [(0, r) for r in reqs])
    retracted = [r for r in reqs if r.retractions]
    assert retracted, "the load must retract"
    assert [r.cached_tokens for r in reqs] == [0, 0, 0, 0]
    assert sched.stats.cached_tokens == 0
    check_drained(sched, worker)


def test_a_retracted_request_keeps_what_it_read_at_first_admission():
    config = SchedulerConfig(vocab_size=V, init_new_token_ratio=0.01, chunked_prefill_size=None)
    sched, worker = make_pair(config, 60, V)
    shared = list(range(1, 17))
    drive(sched, worker, [(0, req("warm", shared, 1))])  # 16 cached tokens for the rest
    reqs = [req(f"r{i}", [*shared, 20 + i, 30 + i], 30) for i in range(3)]
    drive(sched, worker, [(0, r) for r in reqs])
    assert any(r.retractions for r in reqs), "the load must retract"
    assert [r.cached_tokens for r in reqs] == [16, 16, 16]
    assert sched.stats.cached_tokens == 3 * 16


def test_after_a_worker_loss_the_recomputed_tokens_are_not_cached_tokens():
    config = SchedulerConfig(vocab_size=V, page_size=4)
    sched, worker = make_pair(config, 64, V)
    prompt = list(range(1, 33))
    drive(sched, worker, [(0, req("warm", prompt, 1))])
    r = req("reader", [*prompt, 40, 41], 20)
    sched.add_request(r)
    for _ in range(4):  # prefill (reading 32 cached tokens) and a few decodes
        sched.update(worker.execute(sched.step()))
        sched.check_integrity()
    assert r.cached_tokens == 32 and len(r.output_ids) >= 3
    assert sched.stats.cached_tokens == 32
    sched.reset_after_worker_loss(64)  # the cache is gone with the worker
    sched.check_integrity()
    worker = SimulatedWorker(64, 4, V)
    drive(sched, worker, [])
    assert r.finished and len(r.output_ids) == 20
    assert r.cached_tokens == 0  # all 34 + output recomputed
    assert sched.stats.cached_tokens == 0
    check_drained(sched, worker)


def test_after_a_worker_loss_what_the_rebuilt_cache_gives_counts():
    config = SchedulerConfig(vocab_size=V, page_size=4, max_running_requests=1)
    sched, worker = make_pair(config, 64, V)
    prompt = list(range(1, 33))
    first, second = req("first", [*prompt, 50], 6), req("second", [*prompt, 51], 6)
    sched.add_request(first)
    sched.add_request(second)
    sched.update(worker.execute(sched.step()))  # "first" prefills; "second" waits
    sched.reset_after_worker_loss(64)
    worker = SimulatedWorker(64, 4, V)
    drive(sched, worker, [])
    # "first" computes the prompt again; "second", never admitted before,
    # reads its 32 tokens from the rebuilt cache
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert sched.stats.cached_tokens == 32


def test_a_request_that_recomputed_a_cached_prefix_shares_the_rest_while_it_runs():
    """A request wanting its prompt's logprobs computes a cached prefix again
    (its own duplicate pages); the pages after the duplicates still enter the
    cache at plan time, so a request arriving while it runs reads them."""
    config = SchedulerConfig(vocab_size=V, page_size=4, chunked_prefill_size=None)
    sched, worker = make_pair(config, 64, V)
    shared = list(range(1, 9))  # two pages another request cached first
    drive(sched, worker, [(0, req("warm", shared, 1))])
    prompt = [*shared, *range(20, 32)]  # 20 tokens: five pages
    scorer = Request(
        "scorer",
        prompt,
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        logprobs=LogprobOptions(return_logprob=True, logprob_start_len=0),
    )
    late = req("late", [*prompt, 40], 2)
    # "late" arrives two steps after the scorer's prefill was planned
    log = drive(sched, worker, [(0, scorer), (3, late)])
    assert scorer.cached_tokens == 0  # it computed everything for its logprobs
    assert late.cached_tokens == 20  # its prompt, past the scorer's duplicates
    assert len(log.deltas["scorer"]) == 12
    check_drained(sched, worker)


def test_samples_that_each_fill_the_pool_finish_one_after_another():
    """n = 3 samples of a prompt-logprob request whose prompt starts with a
    cached prefix, each needing the whole pool: they run by turns
    (retractions), and none is livelocked by holding (and pinning) duplicates
    of the pages the cache already has."""
    config = SchedulerConfig(vocab_size=V, page_size=4, max_running_requests=8, context_len=192)
    sched, worker = make_pair(config, 48, V)
    prompt = list(range(1, 16))
    drive(sched, worker, [(0, req("warm", prompt[:13], 30))])
    lp = LogprobOptions(return_logprob=True, logprob_start_len=0)
    max_new = 48 * 4 - len(prompt)
    samples = [
        Request(
            f"s-{i}",
            prompt,
            SamplingParams(max_new_tokens=max_new, ignore_eos=True),
            logprobs=lp if i == 0 else LogprobOptions(return_logprob=True),
            waits_for="s-0" if i else None,
        )
        for i in range(3)
    ]
    drive(sched, worker, [(0, r) for r in samples], overlap=1, max_steps=20_000)
    assert all(len(r.output_ids) == max_new for r in samples)
    check_drained(sched, worker)
