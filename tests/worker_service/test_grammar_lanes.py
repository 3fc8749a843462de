"""The compile pool's lane policy (grammar_lanes.py), on its own: fresh jobs
first and smallest first, slow jobs held to processes - 1 slots while fresh
ones wait (the youngest paused), paused ones resumed oldest first."""

from __future__ import annotations

from worker_service.sampling.grammar_lanes import (
    LaneJob,
    LaneState,
    Moves,
    next_slow_at,
    plan_lanes,
)

NOW = 100.0


def waiting(seq: int, size: int = 10) -> LaneJob:
    return LaneJob(seq, size)


def running(seq: int, started_at: float, size: int = 10) -> LaneJob:
    return LaneJob(seq, size, LaneState.RUNNING, started_at)


def paused(seq: int, started_at: float, size: int = 10) -> LaneJob:
    return LaneJob(seq, size, LaneState.PAUSED, started_at)


def seqs(jobs: list[LaneJob]) -> list[int]:
    return [j.seq for j in jobs]


def test_free_processes_take_the_smallest_waiting_jobs_first():
    jobs = [waiting(1, 900), waiting(2, 30), waiting(3, 500), waiting(4, 30)]
    moves = plan_lanes(jobs, processes=2, now=NOW)
    assert seqs(moves.start) == [2, 4]  # smallest; equal sizes by arrival
    assert moves.pause == [] and moves.resume == []


def test_slow_jobs_keep_running_while_nothing_waits():
    jobs = [running(1, NOW - 50), running(2, NOW - 40)]
    assert plan_lanes(jobs, processes=2, now=NOW) == Moves()


def test_a_waiting_job_pauses_the_youngest_slow_one():
    a, b = running(1, NOW - 50), running(2, NOW - 40)
    tiny = waiting(3, 5)
    moves = plan_lanes([a, b, tiny], processes=2, now=NOW)
    assert moves.pause == [b] and moves.start == [tiny] and moves.resume == []


def test_slow_jobs_hold_at_most_processes_minus_one_slots_while_fresh_ones_wait():
    slow = [running(i, NOW - 60 + i) for i in range(1, 4)]  # 1 is the oldest
    fresh = [waiting(10, 7), waiting(11, 3)]
    moves = plan_lanes([*slow, *fresh], processes=3, now=NOW)
    assert seqs(moves.pause) == [3]  # one slot for the fresh lane, not two
    assert seqs(moves.start) == [11]  # the smaller one


def test_a_fresh_job_still_running_keeps_the_fresh_lane():
    slow, fresh = running(1, NOW - 30), running(2, NOW - 0.5)  # 2 is not slow yet
    moves = plan_lanes([slow, fresh, waiting(3)], processes=2, now=NOW)
    assert moves == Moves()  # 3 waits for 2 to finish or turn slow


def test_a_fresh_job_that_turns_slow_is_paused_for_the_next_fresh_one():
    old_slow, turned = running(1, NOW - 30), running(2, NOW - 1.0)
    nxt = waiting(3)
    moves = plan_lanes([old_slow, turned, nxt], processes=2, now=NOW)
    assert moves.pause == [turned] and moves.start == [nxt]


def test_paused_jobs_resume_oldest_first_once_nothing_waits():
    a, b, c = paused(1, NOW - 50), paused(2, NOW - 80), paused(3, NOW - 20)
    moves = plan_lanes([a, b, c, running(4, NOW - 10)], processes=2, now=NOW)
    assert moves.resume == [b] and moves.start == [] and moves.pause == []


def test_nothing_resumes_while_a_fresh_job_waits():
    jobs = [paused(1, NOW - 50), running(2, NOW - 0.2), running(5, NOW - 30), waiting(3)]
    assert plan_lanes(jobs, processes=2, now=NOW) == Moves()


def test_left_over_slots_resume_paused_jobs_after_the_fresh_ones_started():
    jobs = [paused(1, NOW - 50), paused(2, NOW - 40), waiting(3)]
    moves = plan_lanes(jobs, processes=3, now=NOW)
    assert seqs(moves.start) == [3] and seqs(moves.resume) == [1, 2]


def test_one_process_runs_fresh_jobs_and_slow_ones_only_in_between():
    slow = running(1, NOW - 30)
    moves = plan_lanes([slow, waiting(2)], processes=1, now=NOW)
    assert moves.pause == [slow] and seqs(moves.start) == [2]
    assert plan_lanes([paused(1, NOW - 30)], processes=1, now=NOW).resume != []


def test_the_next_change_is_when_a_running_fresh_job_turns_slow():
    jobs = [running(1, NOW - 5), running(2, NOW - 0.25), paused(3, NOW - 0.1), waiting(4)]
    assert next_slow_at(jobs, NOW, slow_s=1.0) == NOW + 0.75
    assert next_slow_at([running(1, NOW - 5)], NOW, slow_s=1.0) is None
