"""Speculative decoding in the scheduler core, with the simulated worker as
the oracle: acceptance lengths, finishes inside drafts, abort and worker loss
with a drafted plan in flight, the drain rule, the radix source on a repeated
greedy prompt, and random text that never drafts."""

from __future__ import annotations

import random

from common.simulated_model import expected_output
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.plan import ForwardMode
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    toy_stop_strings,
)
from tests.scheduler_service.core.support.spec_support import OracleDrafter, RecordingWorker

VOCAB = 50
BIG_VOCAB = 32000


def _pair(config: SchedulerConfig, num_pages: int, drafter=None, vocab: int = VOCAB):
    sched = Scheduler(config, num_pages, stop_strings=toy_stop_strings, drafter=drafter)
    worker = RecordingWorker(num_pages, config.page_size, vocab, drafter=drafter)
    return sched, worker


def _prompt(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def test_every_acceptance_length_and_exact_outputs():
    config = SchedulerConfig(
        speculative_disable_by_batch_size=0, page_size=4, vocab_size=VOCAB, speculative_max_draft=4
    )
    drafter = OracleDrafter(VOCAB, "mixed", seed=1)
    sched, worker = _pair(config, 400, drafter)
    rng = random.Random(0)
    reqs = [
        Request(f"r{i}", _prompt(rng, 5 + i), SamplingParams(max_new_tokens=80, ignore_eos=True))
        for i in range(6)
    ]
    log = drive(sched, worker, [(i, r) for i, r in enumerate(reqs)], overlap=True)
    check_outputs(reqs, config, VOCAB, log)
    check_drained(sched, worker)
    seen = {a for k, a in worker.verified if k == 4}
    assert seen == {0, 1, 2, 3, 4}, seen
    assert sched.stats.spec_steps > 0
    assert sched.stats.spec_accepted_tokens == sum(a for _, a in worker.verified)
    # Drafted steps generate more than one token per row on average.
    assert sched.stats.generated_tokens > sched.stats.steps


def test_finishes_inside_drafts_drop_the_tokens_after_them():
    vocab = VOCAB
    config = SchedulerConfig(
        speculative_disable_by_batch_size=0, page_size=1, vocab_size=vocab, speculative_max_draft=8
    )
    rng = random.Random(5)
    prompts = [_prompt(rng, 6) for _ in range(3)]
    free = [expected_output(p, 40, vocab) for p in prompts]
    # A stop id, a stop string and max_new_tokens, each hit in a drafted row.
    stop_tok = free[0][11]
    reqs = [
        Request(
            "stop-id",
            prompts[0],
            SamplingParams(max_new_tokens=40, stop_token_ids=frozenset({stop_tok})),
        ),
        Request(
            "stop-str",
            prompts[1],
            SamplingParams(max_new_tokens=40, stop_strs=(f"<{free[1][13]}>",)),
        ),
        Request("length", prompts[2], SamplingParams(max_new_tokens=23, ignore_eos=True)),
    ]
    drafter = OracleDrafter(vocab, "right")
    sched, worker = _pair(config, 200, drafter)
    log = drive(sched, worker, [(0, r) for r in reqs], overlap=True)
    check_outputs(reqs, config, vocab, log)
    check_drained(sched, worker)
    assert reqs[2].output_ids == free[2][:23]
    assert all(r.spec_accepted_tokens > 0 for r in reqs)
    # Right drafts past a stop were accepted by the worker and then dropped.
    assert sched.stats.discarded_tokens > 0


def _first_drafted_plan(sched: Scheduler, worker, max_steps: int = 50):
    for _ in range(max_steps):
        plan = sched.step()
        sched.check_integrity()
        if plan is None:
            continue
        if any(e.draft_len for e in plan.entries):
            return plan
        sched.update(worker.execute(plan))
        sched.check_integrity()
    raise AssertionError("no drafted plan")


def test_nothing_is_planned_while_a_drafted_plan_is_in_flight():
    config = SchedulerConfig(speculative_disable_by_batch_size=0, page_size=2, vocab_size=VOCAB)
    sched, worker = _pair(config, 100, OracleDrafter(VOCAB, "mixed"))
    rng = random.Random(2)
    sched.add_request(Request("a", _prompt(rng, 9), SamplingParams(max_new_tokens=30)))
    plan = _first_drafted_plan(sched, worker)
    assert plan.mode is ForwardMode.PREFILL  # drafted extends only
    sched.add_request(Request("b", _prompt(rng, 9), SamplingParams(max_new_tokens=5)))
    assert sched.step() is None and sched.step() is None
    sched.check_integrity()
    sched.update(worker.execute(plan))
    sched.check_integrity()
    assert sched.step() is not None  # b is admitted now


def test_abort_with_a_drafted_plan_in_flight():
    config = SchedulerConfig(speculative_disable_by_batch_size=0, page_size=4, vocab_size=VOCAB)
    sched, worker = _pair(config, 60, OracleDrafter(VOCAB, "right"))
    rng = random.Random(3)
    req = Request("a", _prompt(rng, 10), SamplingParams(max_new_tokens=40))
    sched.add_request(req)
    plan = _first_drafted_plan(sched, worker)
    assert sched.abort("a")
    sched.check_integrity()
    sched.update(worker.execute(plan))  # its tokens arrive for a finished request
    sched.check_integrity()
    assert sched.stats.discarded_tokens > 0
    plan = sched.step()  # the departure
    assert plan is not None and plan.leaves == ["a"]
    sched.update(worker.execute(plan))
    check_drained(sched, worker)


def test_worker_loss_with_a_drafted_plan_in_flight():
    config = SchedulerConfig(speculative_disable_by_batch_size=0, page_size=4, vocab_size=VOCAB)
    drafter = OracleDrafter(VOCAB, "mixed", seed=4)
    sched, worker = _pair(config, 60, drafter)
    rng = random.Random(4)
    reqs = [
        Request(f"r{i}", _prompt(rng, 7 + i), SamplingParams(max_new_tokens=30)) for i in range(3)
    ]
    for r in reqs:
        sched.add_request(r)
    _first_drafted_plan(sched, worker)  # sent, never answered: the worker is gone
    sched.reset_after_worker_loss()
    sched.check_integrity()
    assert all(r.spec is None or r.spec.inflight == 0 for r in reqs)
    worker = RecordingWorker(60, config.page_size, VOCAB, drafter=drafter)
    log = drive(sched, worker, [], overlap=True)
    delivered = {r.rid: r.output_ids for r in reqs}
    log.deltas = delivered  # deliveries before the loss were not collected by drive
    log.finished_deltas = {r.rid: 1 for r in reqs}
    check_outputs(reqs, config, VOCAB, log)
    check_drained(sched, worker)


def test_radix_source_drafts_a_repeated_greedy_answer():
    for page_size in (1, 4):
        config = SchedulerConfig(
            speculative_disable_by_batch_size=0, page_size=page_size, vocab_size=BIG_VOCAB
        )
        sched, worker = _pair(config, 400, vocab=BIG_VOCAB)
        prompt = _prompt(random.Random(6), 37, BIG_VOCAB)
        first = Request("first", prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
        drive(sched, worker, [(0, first)], overlap=True)
        assert first.spec_draft_tokens == 0  # random text: nothing to draft from
        second = Request("second", list(prompt), SamplingParams(max_new_tokens=60, ignore_eos=True))
        steps_before = sched.stats.steps
        drive(sched, worker, [(0, second)], overlap=True)
        assert second.output_ids == first.output_ids
        # The whole answer (but its last partial page) came from the cache,
        # every draft accepted.
        assert second.spec_draft_tokens >= 60 - 2 * page_size - 8
        assert second.spec_accepted_tokens == second.spec_draft_tokens
        assert sched.stats.steps - steps_before < 20
        check_drained(sched, worker)


def test_random_text_never_drafts_and_keeps_overlap():
    def run(spec: bool) -> tuple[Scheduler, int]:
        config = SchedulerConfig(
            speculative_disable_by_batch_size=0, vocab_size=BIG_VOCAB, speculative_ngram=spec
        )
        sched, worker = _pair(config, 4000, vocab=BIG_VOCAB)
        rng = random.Random(7)
        reqs = [
            Request(f"r{i}", _prompt(rng, 200, BIG_VOCAB), SamplingParams(max_new_tokens=150))
            for i in range(8)
        ]
        log = drive(sched, worker, [(i, r) for i, r in enumerate(reqs)], overlap=True)
        check_outputs(reqs, config, BIG_VOCAB, log)
        return sched, log.plans

    sched, plans = run(True)
    assert sched.stats.spec_drains == 0 and sched.stats.spec_steps == 0
    assert all(r.spec_draft_tokens == 0 for r in sched.table)
    _, plans_without = run(False)
    assert plans == plans_without  # the same plans: overlap kept


def test_drafts_that_keep_failing_drive_k_to_zero():
    config = SchedulerConfig(
        speculative_disable_by_batch_size=0, vocab_size=VOCAB, speculative_max_draft=8
    )
    drafter = OracleDrafter(VOCAB, "wrong")
    sched, worker = _pair(config, 2000, drafter)
    rng = random.Random(8)
    reqs = [
        Request(f"r{i}", _prompt(rng, 20), SamplingParams(max_new_tokens=400, ignore_eos=True))
        for i in range(2)
    ]
    log = drive(sched, worker, [(0, r) for r in reqs], overlap=True)
    check_outputs(reqs, config, VOCAB, log)
    stats = sched.stats
    assert stats.spec_accepted_tokens == 0
    # Dormant with a growing backoff: a few probes, not a draft per step.
    assert stats.spec_steps < 20, stats.spec_steps
    assert stats.spec_drains < 20, stats.spec_drains
    assert all(r.spec.k in (0, 1, 2) and r.spec.backoff >= 64 for r in reqs)
    # Probes after backoff are small.
    assert max(k for k, _ in worker.verified) <= 4


def test_grammar_and_opted_out_requests_never_draft():
    config = SchedulerConfig(speculative_disable_by_batch_size=0, vocab_size=VOCAB)
    drafter = OracleDrafter(VOCAB, "right")
    sched, worker = _pair(config, 200, drafter)
    rng = random.Random(9)
    opted_out = Request(
        "off", _prompt(rng, 8), SamplingParams(max_new_tokens=30), speculative=False
    )
    grammar = Request(
        "json",
        _prompt(rng, 8),
        SamplingParams(max_new_tokens=30, grammar=("json_schema", '{"type": "object"}')),
    )
    log = drive(sched, worker, [(0, opted_out), (0, grammar)], overlap=True)
    check_outputs([opted_out, grammar], config, VOCAB, log)
    assert opted_out.spec_draft_tokens == grammar.spec_draft_tokens == 0
    assert drafter.calls == 0 and sched.stats.spec_steps == 0
    off = SchedulerConfig(
        speculative_disable_by_batch_size=0, vocab_size=VOCAB, speculative_ngram=False
    )
    sched, worker = _pair(off, 200, drafter)
    req = Request("a", _prompt(rng, 8), SamplingParams(max_new_tokens=30))
    drive(sched, worker, [(0, req)], overlap=True)
    assert req.spec_draft_tokens == 0 and drafter.calls == 0


def test_short_pages_shrink_the_drafts_instead_of_retracting():
    config = SchedulerConfig(
        speculative_disable_by_batch_size=0, page_size=4, vocab_size=VOCAB, speculative_max_draft=8
    )
    drafter = OracleDrafter(VOCAB, "right")
    sched, worker = _pair(config, 40, drafter)
    req = Request("a", _prompt(random.Random(10), 8), SamplingParams(max_new_tokens=30))
    sched.add_request(req)
    sched.update(worker.execute(sched.step()))  # the prefill: kv_len 8, two full pages
    # Something else holds every page but the one the plain decode needs.
    hog = sched.pool.alloc(sched.pool.num_free - 1)
    plan = sched.step()
    (entry,) = plan.entries
    assert req.spec.k == 4  # it wants 4 drafts; the page holds 3 (positions 8..11)
    assert entry.draft_len == 3 and len(entry.new_pages) == 1 and sched.pool.num_free == 0
    assert sched.stats.retractions == 0
    sched.update(worker.execute(plan))
    sched.pool.release(hog)
    log = drive(sched, worker, [], overlap=True)
    log.deltas = {"a": req.output_ids}
    log.finished_deltas = {"a": 1}
    check_outputs([req], config, VOCAB, log)
    check_drained(sched, worker)


def test_no_drafts_while_more_requests_run_than_the_batch_size_limit():
    config = SchedulerConfig(
        speculative_disable_by_batch_size=2, page_size=4, vocab_size=VOCAB, speculative_max_draft=4
    )
    drafter = OracleDrafter(VOCAB, "right", seed=3)
    sched, worker = _pair(config, 400, drafter)
    running_when_drafted: list[int] = []
    plain_execute = worker.execute

    def execute(plan):
        if any(e.draft_len for e in plan.entries):
            running_when_drafted.append(len(sched.table.running))
        return plain_execute(plan)

    worker.execute = execute
    rng = random.Random(5)
    # Finishing one after another: 6, then 5, ... running.
    reqs = [
        Request(
            f"r{i}", _prompt(rng, 6), SamplingParams(max_new_tokens=10 + 12 * i, ignore_eos=True)
        )
        for i in range(6)
    ]
    log = drive(sched, worker, [(0, r) for r in reqs], overlap=True)
    check_outputs(reqs, config, VOCAB, log)
    check_drained(sched, worker)
    assert running_when_drafted, "the last two requests never drafted"
    assert max(running_when_drafted) <= 2, running_when_drafted
    assert reqs[0].spec_draft_tokens == 0 and reqs[5].spec_accepted_tokens > 0
