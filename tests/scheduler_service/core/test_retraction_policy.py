"""--retraction-policy (SGLang's): which running request a decode out of
memory retracts first. "length" (the default) keeps the most progress;
"priority" takes the lowest priority first, then orders by length, in the
direction --schedule-low-priority-values-first sets."""

from __future__ import annotations

import pytest

from scheduler_service.config import load_config
from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.decode import retraction_order
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

V = 64


def _req(rid: str, n_prompt: int, n_out: int, priority: int) -> Request:
    r = Request(rid, list(range(1, n_prompt + 1)), priority=priority)
    r.output_ids = [1] * n_out
    return r


def _retracted_first(reqs: list[Request], sign: int) -> list[str]:
    return [r.rid for r in retraction_order(reqs, sign)][::-1]  # popped from the end


def test_the_priority_order_takes_the_lowest_priority_first_then_least_progress():
    reqs = [
        _req("low-much", 5, 9, priority=0),
        _req("high-little", 5, 1, priority=7),
        _req("high-long", 50, 1, priority=7),
        _req("mid", 5, 4, priority=3),
    ]
    high_values_first = SchedulerConfig(
        enable_priority_scheduling=True, retraction_policy="priority"
    ).retraction_priority_sign
    assert _retracted_first(reqs, high_values_first) == [
        "low-much",
        "mid",
        "high-long",
        "high-little",
    ]
    low_values_first = SchedulerConfig(
        enable_priority_scheduling=True,
        retraction_policy="priority",
        schedule_low_priority_values_first=True,
    ).retraction_priority_sign
    assert _retracted_first(reqs, low_values_first) == [
        "high-long",
        "high-little",
        "mid",
        "low-much",
    ]
    # "length" ignores priority, as SGLang's default does
    length = SchedulerConfig(enable_priority_scheduling=True).retraction_priority_sign
    assert length == 0
    assert _retracted_first(reqs, length) == ["high-long", "high-little", "mid", "low-much"]


@pytest.mark.parametrize(
    ("policy", "first_retracted"), [("length", {"high-a", "high-b"}), ("priority", {"low"})]
)
def test_a_decode_out_of_memory_retracts_by_the_policy(policy, first_retracted):
    # "low" started first and has the most outputs; two higher-priority
    # requests join it and the 60-page pool runs out while all three decode.
    config = SchedulerConfig(
        vocab_size=V,
        enable_priority_scheduling=True,
        retraction_policy=policy,
        init_new_token_ratio=0.01,  # overcommit, so decoding runs out of pages
        chunked_prefill_size=None,
        priority_preemption_threshold=1 << 20,  # no preemption at admission
    )
    low = Request("low", list(range(1, 11)), SamplingParams(max_new_tokens=30), priority=0)
    highs = [
        Request(rid, list(range(b, b + 10)), SamplingParams(max_new_tokens=30), priority=5)
        for rid, b in (("high-a", 20), ("high-b", 40))
    ]
    sched, worker = make_pair(config, 60, V)
    requeued: list[tuple[str, str]] = []
    sched.on_requeue = lambda req, why: requeued.append((req.rid, why))
    log = drive(sched, worker, [(0, low), (6, highs[0]), (6, highs[1])])
    check_outputs([low, *highs], config, V, log)  # every output exact, retracted or not
    check_drained(sched, worker)
    assert requeued and all(why == "retraction" for _, why in requeued)
    assert requeued[0][0] in first_retracted, requeued


def test_the_priority_policy_needs_priority_scheduling():
    with pytest.raises(ValueError, match="needs --enable-priority-scheduling"):
        SchedulerConfig(retraction_policy="priority")
    with pytest.raises(SystemExit, match="needs --enable-priority-scheduling"):
        load_config(["--worker", "grpc://127.0.0.1:1", "--retraction-policy", "priority"])
    config = load_config(
        [
            "--worker",
            "grpc://127.0.0.1:1",
            "--retraction-policy",
            "priority",
            "--enable-priority-scheduling",
        ]
    )
    assert config.scheduler.retraction_priority_sign == -1  # higher values are kept
