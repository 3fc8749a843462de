from __future__ import annotations

import pytest

from scheduler_service.core.plan import ForwardMode, Join, PlanEntry, StepPlan
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import NO_LOGPROBS, SamplingParams
from scheduler_service.testing.simulated_worker import (
    SimulatedWorker,
    SimulatedWorkerError,
    expected_output,
)


def join(rid, prefix=(), prompt_len=4):
    return Join(rid, SamplingParams(), NO_LOGPROBS, prompt_len, prefix_ids=list(prefix))


def prefill(rid, start, tokens, pages, sample=True):
    return PlanEntry(
        Request(rid, [1]), 0, start, list(tokens), new_pages=list(pages), sample=sample
    )


def decode(rid, start, pages=()):
    return PlanEntry(Request(rid, [1]), 0, start, None, new_pages=list(pages), sample=True)


def test_generates_the_oracles_tokens():
    w = SimulatedWorker(num_pages=8, page_size=2, vocab_size=50)
    out = w.execute(
        StepPlan(
            1, ForwardMode.PREFILL, extends=[prefill("a", 0, [1, 2, 3], [0, 1])], joins=[join("a")]
        )
    )
    tokens = [out.outputs[0].token_id]
    for step in range(2, 5):
        plan = StepPlan(step, ForwardMode.DECODE, decodes=[decode("a", step + 1)])
        if step == 3:
            plan.decodes[0].new_pages = [2]
        tokens.append(w.execute(plan).outputs[0].token_id)
    assert tokens == expected_output([1, 2, 3], 4, 50)


def test_a_prefix_read_through_the_wrong_pages_is_caught():
    w = SimulatedWorker(num_pages=8, page_size=2, vocab_size=50)
    w.execute(
        StepPlan(
            1,
            ForwardMode.PREFILL,
            extends=[prefill("a", 0, [1, 2, 3, 4], [0, 1])],
            joins=[join("a")],
        )
    )
    # "b" claims the cached prefix [1, 2, 3, 4] but names page 2 (never written).
    bad = StepPlan(
        2,
        ForwardMode.PREFILL,
        extends=[prefill("b", 4, [9], [2, 3, 4])],
        joins=[join("b", [1, 2, 3, 4])],
    )
    with pytest.raises(SimulatedWorkerError, match="position 0"):
        w.execute(bad)


def test_a_page_overwritten_by_another_request_is_caught():
    w = SimulatedWorker(num_pages=8, page_size=2, vocab_size=50)
    w.execute(
        StepPlan(
            1, ForwardMode.PREFILL, extends=[prefill("a", 0, [1, 2, 3], [0, 1])], joins=[join("a")]
        )
    )
    # Page 1 given to "b" while "a" still reads it.
    w.execute(
        StepPlan(2, ForwardMode.PREFILL, extends=[prefill("b", 0, [7, 7], [1])], joins=[join("b")])
    )
    step3 = StepPlan(3, ForwardMode.DECODE, decodes=[decode("a", 3)])
    with pytest.raises(SimulatedWorkerError, match="position 2"):
        w.execute(step3)


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        (StepPlan(1, ForwardMode.DECODE, decodes=[decode("x", 0, [0])]), "unknown"),
        (StepPlan(1, ForwardMode.IDLE, leaves=["x"]), "does not hold"),
        (
            StepPlan(
                1, ForwardMode.PREFILL, extends=[prefill("a", 2, [1], [0])], joins=[join("a")]
            ),
            "starts at 2",
        ),
        (
            StepPlan(
                1, ForwardMode.PREFILL, extends=[prefill("a", 0, [1, 2, 3], [0])], joins=[join("a")]
            ),
            "past",
        ),
        (
            StepPlan(
                1, ForwardMode.PREFILL, extends=[prefill("a", 0, [1], [99])], joins=[join("a")]
            ),
            "outside",
        ),
    ],
)
def test_malformed_plans_are_refused(plan, needle):
    w = SimulatedWorker(num_pages=8, page_size=2, vocab_size=50)
    with pytest.raises(SimulatedWorkerError, match=needle):
        w.execute(plan)


def test_expected_output_stops_after_min_new_tokens():
    free = expected_output([5, 6], 30, 50)
    stop = free[0]
    assert expected_output([5, 6], 30, 50, frozenset({stop})) == free[:1]
    held = expected_output([5, 6], 30, 50, frozenset({stop}), min_new_tokens=1)
    assert held[0] == stop and len(held) > 1 and held == free[: len(held)]
