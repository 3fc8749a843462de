"""The load's queue figures (a walk over the waiting requests) are taken
every step while the queue is short, and at most every FIGURES_S while it
is long: a queue of thousands would otherwise cost a millisecond a step."""

from __future__ import annotations

from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.engine import loop
from scheduler_service.engine.loop import Engine


def _engine(waiting: int) -> tuple[Engine, list[int]]:
    cfg = SchedulerConfig(page_size=4, max_running_requests=8)
    sched = Scheduler(cfg, 4096)
    for i in range(waiting):
        sched.add_request(Request(f"w{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4)))
    walks: list[int] = []
    figures = sched.load_figures

    def counted():
        walks.append(1)
        return figures()

    sched.load_figures = counted
    return Engine(sched, None, None, overlap_depth=1, recovery_timeout_s=60), walks


def test_short_queue_figures_are_fresh_every_load():
    eng, walks = _engine(loop.FIGURES_EVERY_STEP_UP_TO)
    for _ in range(3):
        assert eng.load().waiting_uncached_tokens == 5 * loop.FIGURES_EVERY_STEP_UP_TO
    assert len(walks) == 3


def test_long_queue_figures_are_reused_within_the_interval(monkeypatch):
    n = loop.FIGURES_EVERY_STEP_UP_TO + 1
    eng, walks = _engine(n)
    monkeypatch.setattr(loop, "FIGURES_S", 3600.0)
    for _ in range(3):
        assert eng.load().waiting_uncached_tokens == 5 * n
    assert len(walks) == 1
    monkeypatch.setattr(loop, "FIGURES_S", 0.0)  # the interval passed: walked again
    eng.sched.add_request(Request("late", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    assert eng.load().waiting_uncached_tokens == 5 * n + 3
    assert len(walks) == 2
