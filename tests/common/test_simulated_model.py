"""One simulated model: the worker's ``--model simulated`` and the scheduler
tests' in-process oracle generate the same tokens, both those of
``expected_output``, whatever the chunking."""

from __future__ import annotations

from common.simulated_model import absorb, expected_output, simulated_token, token_of
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.testing.simulated_worker import SimulatedWorker
from tests.scheduler_service.core.support.sim_driver import drive
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.worker_factory import runner_for

VOCAB = 500
PROMPTS = [list(range(3, 40)), [7] * 5, list(range(400, 480, 3))]


def test_the_hash_is_incremental():
    ctx = [1, 2, 3, 70_000, 5]
    assert absorb(absorb(0, ctx[:2]), ctx[2:]) == absorb(0, ctx)
    assert simulated_token(ctx, VOCAB) == token_of(absorb(0, ctx), VOCAB)
    out = expected_output(ctx, 4, VOCAB)
    assert out[1] == simulated_token([*ctx, out[0]], VOCAB)


def test_the_worker_and_the_oracle_generate_the_same_tokens():
    runner = runner_for("simulated", simulated_vocab=VOCAB, page_size=4, num_pages=256)
    worker_reqs = [DriverRequest(list(p), max_new=9) for p in PROMPTS]
    PlanDriver(runner, page_size=4, chunk=8).run(worker_reqs)
    config = SchedulerConfig(page_size=4, vocab_size=VOCAB, chunked_prefill_size=8)
    sched = Scheduler(config, 256)
    reqs = [
        Request(f"r{i}", list(p), SamplingParams(max_new_tokens=9)) for i, p in enumerate(PROMPTS)
    ]
    drive(sched, SimulatedWorker(256, 4, VOCAB), [(0, r) for r in reqs])
    for p, w, r in zip(PROMPTS, worker_reqs, reqs, strict=True):
        want = expected_output(p, 9, VOCAB)
        assert w.outputs == want
        assert r.output_ids == want
