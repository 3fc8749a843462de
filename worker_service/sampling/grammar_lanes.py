"""Which grammar compiles run, wait, pause or resume: the compile pool's
policy, kept apart from its processes so it can be tested directly.

``processes`` compile processes run at a time. A job is *fresh* until it has
run ``slow_s``, then *slow*. Fresh jobs go first, smallest grammar first (most
grammars compile in milliseconds; the ones that take seconds are big). While a
fresh job waits, slow jobs may hold at most ``processes - 1`` running slots:
the youngest slow jobs beyond that are paused (SIGSTOP: they keep their
progress) and resumed, oldest first, when a slot frees and no fresh job waits.
So a flood of hard grammars delays the requests that carry them, and a small
grammar behind them waits at most for the fresh lane (about ``slow_s`` per
fresh job ahead of it). Slow jobs keep first-come order: the oldest, closest
to done, run; the others wait paused rather than sharing the slots, which
would make them all finish late or time out together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

SLOW_S = 1.0  # a compile running longer is slow


class LaneState(Enum):
    WAITING = "waiting"  # not started yet
    RUNNING = "running"
    PAUSED = "paused"  # started, stopped by SIGSTOP


@dataclass(eq=False)
class LaneJob:
    seq: int  # arrival order
    size: int  # bytes of grammar text
    state: LaneState = LaneState.WAITING
    started_at: float | None = None  # when it first ran (monotonic seconds)

    def slow(self, now: float, slow_s: float) -> bool:
        return self.started_at is not None and now - self.started_at >= slow_s


@dataclass
class Moves:
    pause: list[LaneJob] = field(default_factory=list)
    resume: list[LaneJob] = field(default_factory=list)
    start: list[LaneJob] = field(default_factory=list)


def _age(job: LaneJob) -> tuple[float, int]:
    return (job.started_at or 0.0, job.seq)


def plan_lanes(
    jobs: Iterable[LaneJob], processes: int, now: float, slow_s: float = SLOW_S
) -> Moves:
    """The moves that bring ``jobs`` to the policy above; applying them is the
    caller's (it also sets the states and ``started_at``)."""
    jobs = list(jobs)
    waiting = sorted(
        (j for j in jobs if j.state is LaneState.WAITING), key=lambda j: (j.size, j.seq)
    )
    running = [j for j in jobs if j.state is LaneState.RUNNING]
    paused = sorted((j for j in jobs if j.state is LaneState.PAUSED), key=_age)
    slow_running = sorted((j for j in running if j.slow(now, slow_s)), key=_age)
    slow_cap = processes - 1 if waiting else processes
    moves = Moves(pause=slow_running[max(slow_cap, 0) :])
    free = processes - len(running) + len(moves.pause)
    moves.start = waiting[: max(free, 0)]
    free -= len(moves.start)
    if len(moves.start) == len(waiting) and free > 0:
        moves.resume = paused[:free]
    return moves


def next_slow_at(jobs: Iterable[LaneJob], now: float, slow_s: float = SLOW_S) -> float | None:
    """When the next running job turns slow (the plan may change then)."""
    times = [
        j.started_at + slow_s
        for j in jobs
        if j.state is LaneState.RUNNING and j.started_at is not None and not j.slow(now, slow_s)
    ]
    return min(times, default=None)
