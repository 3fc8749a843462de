"""The worker codec's sliding-window fields: a scheduler with a sliding pool
sends each extend's sliding pages (Extend.new_swa_pages, 0 for the null
page) and each decode's (StepPlan.decode_new_swa_pages, page + 1); one
without sends none of them."""

from __future__ import annotations

from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.plan import ForwardMode
from scheduler_service.engine.worker_codec import WorkerCodec
from tests.scheduler_service.core.support.sim_driver import make_pair

V = 40


def _plans(num_swa_pages: int) -> list[tuple[WorkerCodec, pb.StepPlan, object]]:
    cfg = SchedulerConfig(page_size=4, eos_token_ids=frozenset({0}), vocab_size=V)
    sched, worker = make_pair(cfg, 64, V, num_swa_pages=num_swa_pages, swa_window=6)
    codec = WorkerCodec(sliding=num_swa_pages > 0)
    sched.add_request(Request("a", list(range(1, 15)), SamplingParams(max_new_tokens=12)))
    out = []
    while (plan := sched.step()) is not None:
        out.append((codec, codec.encode(plan), plan))
        result = worker.execute(plan)
        sched.update(codec.decode(_answer(result, plan), plan))
    return out


def _answer(result, plan) -> pb.StepResult:
    sampled = [e for e in plan.extends if e.sample] + plan.decodes
    by_rid = {o.rid: o.token_id for o in result.outputs}
    return pb.StepResult(
        step_id=plan.step_id,
        token_ids=[by_rid[e.rid] for e in sampled],
        logprobs=[0.0] * len(sampled),
    )


def test_sliding_pages_ride_along_with_the_full_ones():
    plans = _plans(num_swa_pages=16)
    first = plans[0][1]
    assert list(first.extends[0].new_swa_pages) == list(plans[0][2].extends[0].new_swa_pages)
    assert len(first.extends[0].new_swa_pages) == len(first.extends[0].new_pages) == 4
    assert 0 not in first.extends[0].new_swa_pages  # freed only after the step is planned
    decodes = [(msg, plan) for _, msg, plan in plans if plan.mode is ForwardMode.DECODE]
    assert decodes
    starting = 0
    for msg, plan in decodes:
        assert len(msg.decode_new_swa_pages) == len(msg.decode_new_pages)
        for wire, e in zip(msg.decode_new_swa_pages, plan.decodes, strict=True):
            assert wire == (e.new_swa_pages[0] + 1 if e.new_swa_pages else 0)
            starting += wire > 0
    assert starting >= 2


def test_without_a_sliding_pool_no_sliding_field_is_sent():
    for _, msg, _ in _plans(num_swa_pages=0):
        assert not msg.decode_new_swa_pages
        assert all(not e.new_swa_pages for e in msg.extends)
