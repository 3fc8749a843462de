"""WorkerRecovery (engine/recovery.py) through its public methods, with a
real Scheduler and a stand-in group over the simulated worker: a loss keeps
the requests (they finish with the oracle's output on the group that comes
back), reconnects back off, the outage clock spans a flapping group, a
group of another model shape is not used, and a request charged with three
failed steps is failed alone. The clock is the test's."""

from __future__ import annotations

import pytest

from scheduler_service.core import Request, SamplingParams
from scheduler_service.engine import recovery
from scheduler_service.engine.recovery import RETRY_FIRST_S, RETRY_MAX_S, SETTLE_S
from scheduler_service.engine.worker_group import WorkerError
from tests.scheduler_service.engine.support.sim_group import (
    oracle,
    run_steps,
    scheduler_and_group,
)

V = 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(recovery, "time", c)
    return c


def _req(rid: str, n_prompt: int = 9, max_new: int = 12) -> Request:
    return Request(rid, [(7 * i + len(rid)) % V for i in range(n_prompt)], SamplingParams(max_new))


def test_a_lost_group_keeps_its_requests_and_they_finish_as_the_oracle_says(clock):
    sched, group = scheduler_and_group(vocab_size=V)
    rec = recovery.WorkerRecovery(sched, group, timeout_s=30)
    reqs = [_req(f"r{i}", n_prompt=5 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    run_steps(sched, group.worker, got, steps=4)
    assert sched.table.running and sched.pool.num_free < sched.pool.num_pages
    rec.lost("stream broke")
    assert (rec.connected, rec.losses, group.dropped) == (False, 1, 1)
    assert set(sched.live_rids()) == {r.rid for r in reqs}  # nobody dropped
    assert not sched.table.running and sched.pool.num_free == sched.pool.num_pages
    sched.check_integrity()
    assert not rec.try_reconnect() and group.connects == 0  # not due yet
    clock.now += RETRY_FIRST_S
    assert rec.try_reconnect()
    assert (rec.connected, rec.recoveries, group.opened) == (True, 1, 2)
    run_steps(sched, group.worker, got)
    for r in reqs:
        assert got[r.rid] == oracle(r, V), r.rid


def test_reconnect_attempts_back_off_to_the_cap(clock):
    sched, group = scheduler_and_group(vocab_size=V)
    rec = recovery.WorkerRecovery(sched, group, timeout_s=60)
    rec.lost("stream broke")
    group.reachable = False
    gaps = []
    for _ in range(6):
        wait = rec.wait_s()
        gaps.append(wait)
        clock.now += wait
        before = group.connects
        assert not rec.try_reconnect()
        assert group.connects == before + 1
    assert gaps == [RETRY_FIRST_S, 0.5, 1.0, RETRY_MAX_S, RETRY_MAX_S, RETRY_MAX_S]
    group.reachable = True
    clock.now += rec.wait_s()
    assert rec.try_reconnect() and rec.connected


def test_past_the_timeout_it_gives_up_on_the_requests_and_a_flapping_group_is_one_outage(clock):
    sched, group = scheduler_and_group(vocab_size=V)
    rec = recovery.WorkerRecovery(sched, group, timeout_s=5)
    rec.lost("stream broke")
    clock.now += 1.0
    assert rec.try_reconnect()  # back after 1 s...
    clock.now += 2.0
    rec.lost("stream broke again")  # ...but lost before it settled
    clock.now += 1.9
    assert not rec.expired()
    assert rec.wait_s() <= 0.25  # woken by the next attempt, before the deadline
    clock.now += 0.1  # 5 s since the first loss
    assert rec.expired()
    assert rec.message == (
        "worker group lost and not back within 5 s (it came back 1 times since the first "
        f"loss but never stayed up for {SETTLE_S:g} s)"
    )
    clock.now += rec.wait_s()
    assert rec.try_reconnect()
    clock.now += SETTLE_S  # settled: the next loss is a new outage with its own clock
    rec.lost("a new outage")
    assert not rec.expired()
    assert rec.message == "worker group lost and not back within 5 s"


def test_a_group_back_with_another_model_shape_is_not_used_and_a_new_pool_size_is_taken(clock):
    sched, group = scheduler_and_group(vocab_size=V, num_pages=64)
    rec = recovery.WorkerRecovery(sched, group, timeout_s=30)
    rec.lost("stream broke")
    group.vocab_size = V * 2
    clock.now += rec.wait_s()
    assert not rec.try_reconnect()
    assert group.opened == 1 and group.dropped == 2  # its streams dropped again
    group.vocab_size, group.num_pages = V, 96
    clock.now += rec.wait_s()
    assert rec.try_reconnect()
    assert sched.pool.num_pages == 96


def test_a_refused_session_or_a_failed_preparation_fails_the_attempt(clock):
    sched, group = scheduler_and_group(vocab_size=V)
    prepared = []

    def before_open() -> None:
        prepared.append(group.opened)
        if len(prepared) == 1:
            raise WorkerError("adapter sql: worker unreachable")

    rec = recovery.WorkerRecovery(sched, group, timeout_s=30, before_open=before_open)
    rec.lost("stream broke")
    clock.now += rec.wait_s()
    assert not rec.try_reconnect() and group.opened == 1  # prepared, never opened
    group.refuse_open = "worker 127.0.0.1:1 is held by a newer scheduler session"
    clock.now += rec.wait_s()
    assert not rec.try_reconnect() and not rec.connected
    group.refuse_open = ""
    clock.now += rec.wait_s()
    assert rec.try_reconnect() and group.opened == 2
    assert prepared == [1, 1, 1]  # before every opening


def test_a_request_charged_with_three_failed_steps_is_failed_alone(clock):
    sched, group = scheduler_and_group(vocab_size=V)
    rec = recovery.WorkerRecovery(sched, group, timeout_s=30)
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, b, c):
        sched.add_request(r)
    assert rec.step_failed({"a", "b", "c"}) == []
    assert rec.step_failed({"a", "c", "gone"}) == []  # a rid with no request is not charged
    assert rec.step_failed({"a", "b"}) == ["a"]
    assert rec.step_failed({"b"}) == ["b"]
    # c has two; a new request that reuses its rid starts from none
    sched.abort("c")
    sched.add_request(_req("c"))
    assert rec.step_failed({"c"}) == [] and rec.step_failed({"c"}) == []
    assert rec.step_failed({"c"}) == ["c"]
