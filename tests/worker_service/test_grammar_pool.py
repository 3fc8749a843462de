"""The grammar compile pool with its real processes (the zygote and its
compile children, real xgrammar compiles over the simulated model's
vocabulary): small grammars overtake slow ones, which pause and resume; a
compile past its deadline, or that nobody waits for any more, is killed at
once; the waiting bound refuses at once; a child that dies fails its job
without a verdict; compiled grammars come back usable into a cache bounded
by bytes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.worker_service.support.grammar_load import nested_schema, state, wait_for, wait_gone
from worker_service.sampling.grammar import GrammarCompiler, GrammarError, simulated_tokenizer_info
from worker_service.sampling.grammar_pool import CompilePool, PoolFull

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

VOCAB = 1024
SLOW = 400  # nesting depth: 7 s and more to compile, far past every wait below


def info_json() -> str:
    return simulated_tokenizer_info(VOCAB).serialize_json()


@pytest.fixture(scope="module")
def pool():
    pool = CompilePool(info_json, processes=2, max_waiting=4)
    ticket = pool.submit("regex", "warm", time.monotonic() + 120)
    try:
        outcome = ticket.wait(120)  # the zygote's start: xgrammar's import
    finally:
        pool.release(ticket)
    assert outcome is not None and outcome.payload
    yield pool
    pool.close()


def later(seconds: float) -> float:
    return time.monotonic() + seconds


def running_pid(ticket, timeout_s: float = 10) -> int:
    wait_for(lambda: ticket.pid is not None, timeout_s, "the job to start")
    return ticket.pid


def test_a_small_grammar_overtakes_slow_ones_which_pause_and_resume(pool):
    slow = [pool.submit("json_schema", nested_schema(SLOW, f"o{i}_"), later(60)) for i in range(3)]
    try:
        pids = [running_pid(t) for t in slow[:2]]
        # At 1 s both are slow and the third waits: the younger one pauses.
        wait_for(lambda: slow[2].pid is not None, 10, "the third job to get a process")
        wait_for(lambda: state(pids[1]) == "T", 1, "the younger slow job to pause")
        assert state(pids[0]) in ("R", "S")
        wait_for(lambda: time.monotonic() - slow[2].job.lane.started_at > 1.2, 10, "slow")
        t0 = time.monotonic()
        tiny = pool.submit("regex", "(yes|no)!", later(30))
        try:
            outcome = tiny.wait(30)
            took = time.monotonic() - t0
        finally:
            pool.release(tiny)
        assert outcome is not None and outcome.payload and not outcome.error
        assert took < 2.0, f"the small grammar waited {took:.2f} s behind slow ones"
        # Done: the oldest paused job resumes; two run, one stays paused.
        wait_for(
            lambda: sorted(state(t.pid) in ("R", "S") for t in slow) == [False, True, True],
            5,
            "two slow jobs running, one paused",
        )
        assert state(slow[0].pid) in ("R", "S")  # the oldest never paused for long
    finally:
        live = [t.pid for t in slow if t.pid is not None]
        for t in slow:
            pool.release(t)
    for pid in live:  # nobody waits: killed, paused ones included
        assert wait_gone(pid, 1.0) is not None, f"compile process {pid} still there"


def test_a_compile_past_its_deadline_is_killed_at_once(pool):
    ticket = pool.submit("json_schema", nested_schema(SLOW, "d_"), later(1.5))
    try:
        pid = running_pid(ticket)
        outcome = ticket.wait(10)
        assert outcome is not None and outcome.timed_out and not outcome.error
        gone = wait_gone(pid, 1.0)
        assert gone is not None, f"compile process {pid} outlived its deadline: {state(pid)}"
        # Asked again before the first caller let go: a new compile, not the timeout.
        again = pool.submit("json_schema", nested_schema(SLOW, "d_"), later(30))
        try:
            assert again.job is not ticket.job
            running_pid(again)
        finally:
            pool.release(again)
    finally:
        pool.release(ticket)


def test_a_shared_compile_is_killed_when_its_last_waiter_leaves(pool):
    text = nested_schema(SLOW, "s_")
    first = pool.submit("json_schema", text, later(60))
    second = pool.submit("json_schema", text, later(60))
    try:
        assert second.job is first.job  # one compile for both
        pid = running_pid(first)
        pool.release(first)
        time.sleep(0.3)
        assert state(pid) in ("R", "S"), "killed while someone still waits"
    finally:
        pool.release(first)
        pool.release(second)
    assert wait_gone(pid, 1.0) is not None


def test_past_its_bound_the_pool_refuses_at_once(pool):
    tickets = [
        pool.submit("json_schema", nested_schema(SLOW, f"b{i}_"), later(60)) for i in range(4)
    ]
    try:
        t0 = time.monotonic()
        with pytest.raises(PoolFull, match="4 grammar compiles already waiting"):
            pool.submit("regex", "x", later(60))
        assert time.monotonic() - t0 < 0.1
    finally:
        for t in tickets:
            pool.release(t)
    assert pool.waiting() == 0
    ticket = pool.submit("regex", "x", later(30))  # room again
    try:
        outcome = ticket.wait(30)
        assert outcome is not None and outcome.payload
    finally:
        pool.release(ticket)


def test_a_child_that_dies_fails_its_job_without_a_verdict(pool):
    ticket = pool.submit("json_schema", nested_schema(SLOW, "k_"), later(60))
    try:
        os.kill(running_pid(ticket), signal.SIGKILL)
        outcome = ticket.wait(10)
        assert outcome is not None and outcome.failure and not outcome.error
        assert not outcome.timed_out
    finally:
        pool.release(ticket)
    again = pool.submit("regex", "[0-9]+", later(30))
    try:
        outcome = again.wait(30)
        assert outcome is not None and outcome.payload
    finally:
        pool.release(again)


def test_compiled_grammars_come_back_usable_into_a_cache_bounded_by_bytes():
    grammars = GrammarCompiler(
        lambda: simulated_tokenizer_info(VOCAB), capacity_bytes=500_000, processes=1
    )
    try:
        assert grammars.compile_in_pool("regex", "(ab)+c", 120) > 0
        state_ = grammars.matcher("regex", "(ab)+c", [ord("a"), ord("b")])
        assert state_.accept(ord("c")) and state_.ended is False
        assert not state_.accept(ord("x"))
        with pytest.raises(GrammarError, match="parenthesis is not closed"):
            grammars.compile_in_pool("regex", "a(b", 30)
        big = nested_schema(60, "m_")  # 0.2 MB compiled: three overflow 0.5 MB
        for i in range(3):
            grammars.compile_in_pool("json_schema", big.replace("m_", f"m{i}_"), 60)
        assert not grammars.cached("regex", "(ab)+c")  # the oldest went first
        assert not grammars.cached("json_schema", big.replace("m_", "m0_"))
        assert grammars.cached("json_schema", big.replace("m_", "m2_"))
        assert grammars.compile_in_pool("json_schema", big.replace("m_", "m2_"), 1) == 0.0
    finally:
        grammars.close()


def test_compile_processes_that_cannot_start_fail_the_waiting_jobs():
    broken = CompilePool(lambda: "not tokenizer info", processes=1, max_waiting=2)
    try:
        ticket = broken.submit("regex", "x", later(120))
        try:
            outcome = ticket.wait(120)
        finally:
            broken.release(ticket)
        assert outcome is not None and "did not start" in outcome.failure
        assert not outcome.timed_out
    finally:
        broken.close()
