"""The step deadline: fixed, or max(floor, factor x p99 of recent waits); the
watchdog fires once past it and never while disarmed."""

from __future__ import annotations

import threading
import time

from scheduler_service.engine.step_deadline import (
    FACTOR,
    FLOOR_S,
    PER_TOKEN_MIN_TOKENS,
    PRIOR_S_PER_TOKEN,
    RECOMPUTE_EVERY,
    WINDOW,
    StepDeadline,
    Watchdog,
)


def test_the_derived_deadline_keeps_its_floor_for_fast_steps():
    d = StepDeadline()
    for _ in range(WINDOW):
        d.observe(0.02)
    assert d.current_s == FLOOR_S


def test_the_derived_deadline_follows_slow_steps_by_their_p99():
    d = StepDeadline()
    for i in range(WINDOW):
        d.observe(10.0 if i % 10 == 0 else 1.0)  # 10% slow steps: the p99 is slow
    assert d.current_s == FACTOR * 10.0
    for _ in range(WINDOW):  # the window moves on: fast steps again
        d.observe(0.5)
    assert d.current_s == FLOOR_S


def test_the_deadline_is_recomputed_in_batches_not_per_step():
    d = StepDeadline()
    for _ in range(RECOMPUTE_EVERY - 1):
        d.observe(100.0)
    assert d.current_s == FLOOR_S
    d.observe(100.0)
    assert d.current_s == FACTOR * 100.0


def test_a_fixed_deadline_ignores_what_it_observes():
    d = StepDeadline(fixed_s=2.5)
    for _ in range(WINDOW):
        d.observe(100.0)
    assert d.current_s == 2.5


def test_the_watchdog_fires_once_past_the_deadline_and_not_when_disarmed():
    fired: list[tuple[str, float]] = []
    event = threading.Event()

    def expired(what: str, timeout_s: float) -> None:
        fired.append((what, timeout_s))
        event.set()

    dog = Watchdog(expired)
    try:
        dog.arm(0.1, "a step result")
        dog.disarm()
        time.sleep(0.3)
        assert fired == []
        dog.arm(0.1, "a step result")
        assert event.wait(2)
        time.sleep(0.2)
        assert fired == [("a step result", 0.1)]
    finally:
        dog.close()


def test_a_step_of_many_tokens_gets_the_time_its_tokens_take():
    """A prompt at the context limit prefilled in one step on a CPU took 190 s
    and was declared hung at the 60 s floor, three times over."""
    d = StepDeadline()
    assert d.for_step(1) == FLOOR_S
    assert d.for_step(8192) == 8192 * PRIOR_S_PER_TOKEN  # before any big step was seen
    for _ in range(RECOMPUTE_EVERY):
        d.observe(0.5, tokens=PER_TOKEN_MIN_TOKENS - 1)  # small steps say nothing per token
    assert d.per_token_s == PRIOR_S_PER_TOKEN
    for _ in range(RECOMPUTE_EVERY):
        d.observe(1.0, tokens=100)  # 10 ms a token
    assert d.per_token_s == FACTOR * 0.01
    assert d.for_step(8192) == 8192 * FACTOR * 0.01
    assert d.for_step(100) == FLOOR_S  # the floor still rules the usual steps
    assert StepDeadline(fixed_s=2.5).for_step(8192) == 2.5  # the flag is the flag
