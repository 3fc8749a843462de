"""lpm's aging: a prompt that matches nothing in the cache is not starved by
a steady stream of prefix-matching ones. Without aging lpm takes the matching
ones first for as long as one waits, so the short prompt never runs; with
``lpm_max_wait_s`` it runs once it has waited that long."""

from __future__ import annotations

import pytest

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from tests.scheduler_service.core.support.sim_driver import make_pair

V = 64
STEP_S = 0.01  # the test's clock moves this much per step
PREFIX = [5] * 48  # shared by the stream, cached after the first one ran


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(max_wait_s: float, steps: int) -> tuple[int | None, int]:
    """Keep 4 prefix-matching requests waiting at every step; return the step
    the short request was first scheduled at (None: never) and how many of the
    stream finished meanwhile."""
    config = SchedulerConfig(
        vocab_size=V, schedule_policy="lpm", max_running_requests=2, lpm_max_wait_s=max_wait_s
    )
    clock = Clock()
    sched, worker = make_pair(config, 1024, V, clock=clock)
    made = 0

    def matching() -> Request:
        nonlocal made
        made += 1
        return Request(f"m{made}", [*PREFIX, made % V, 7], SamplingParams(max_new_tokens=4))

    short = Request("short", [9, 8, 7], SamplingParams(max_new_tokens=4))
    scheduled_at = None
    for step in range(steps):
        if step == 5:  # once the prefix is cached
            sched.add_request(short)
        while sum(r is not short for r in sched.table.waiting) < 4:
            sched.add_request(matching())
        plan = sched.step()
        sched.check_integrity()
        if plan is not None:
            sched.update(worker.execute(plan))
            sched.check_integrity()
        sched.drain()
        if scheduled_at is None and short.times.first_scheduled is not None:
            scheduled_at = step
        clock.now += STEP_S
    finished = sched.stats.finished.get("length", 0)
    return scheduled_at, finished


def test_without_aging_lpm_starves_a_prompt_that_matches_nothing():
    scheduled_at, finished = _run(max_wait_s=0.0, steps=400)
    assert finished > 100  # the stream kept running ...
    assert scheduled_at is None  # ... and the short prompt never did


@pytest.mark.parametrize("max_wait_s", [0.5, 1.0])
def test_aging_runs_it_once_it_has_waited_long_enough(max_wait_s):
    scheduled_at, finished = _run(max_wait_s=max_wait_s, steps=400)
    assert scheduled_at is not None, "starved"
    waited = (scheduled_at - 5) * STEP_S
    # not before its wait is up (lpm still prefers the matching ones) ...
    assert waited >= max_wait_s - STEP_S
    # ... and at the first step after it that has room
    assert waited <= max_wait_s + 5 * STEP_S
    assert finished > 100


def test_the_default_ages():
    assert SchedulerConfig().lpm_max_wait_s > 0
