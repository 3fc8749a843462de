"""CompileGrammar on a real worker process (the simulated model): a compile
that outlives its call's deadline, or whose call is cancelled, is killed (its
process leaves /proc, the worker's CPU goes idle); past the compile queue's
bound the call answers RESOURCE_EXHAUSTED at once and the worker's other
RPCs still answer."""

from __future__ import annotations

import time

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.worker_service.support.grammar_load import (
    descendants,
    nested_schema,
    state,
    tree_cpu_s,
    wait_for,
    wait_gone,
)
from tests.worker_service.support.worker_process import WorkerProc

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

QUEUE = 3
SLOW = 400  # nesting depth: 7 s and more to compile


KINDS = {"regex": pb.GRAMMAR_KIND_REGEX, "json_schema": pb.GRAMMAR_KIND_JSON_SCHEMA}


def request(kind: str, text: str) -> pb.CompileGrammarRequest:
    return pb.CompileGrammarRequest(grammar=pb.Grammar(kind=KINDS[kind], text=text))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    args = ("--model", "simulated", "--simulated-vocab", "1024")
    proc = WorkerProc(
        tmp_path_factory.mktemp("grammar_rpc"),
        (*args, "--grammar-compile-queue", str(QUEUE), "--log-level", "info"),
        "w",
    )
    try:
        channel = grpc.insecure_channel(proc.address())
        stub = worker_pb2_grpc.WorkerStub(channel)
        # The first compile starts the compile processes (xgrammar's import).
        assert not stub.CompileGrammar(request("regex", "warm"), timeout=120).error
        yield proc, stub
        channel.close()
    finally:
        proc.stop()


def compile_processes(worker_pid: int) -> list[int]:
    """The compile children: below the zygote, the worker's child."""
    return [p for p in descendants(worker_pid) if _ppid(p) != worker_pid]


def busy(worker_pid: int) -> list[int]:
    """Compile children running or paused (idle ones sleep on their socket)."""
    return [p for p in compile_processes(worker_pid) if state(p) in ("R", "T")]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except OSError:
        return -1


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[16])


def idle_cpu(worker_pid: int) -> float:
    """CPU seconds the worker and all its processes use over the next second."""
    before = tree_cpu_s(worker_pid)
    time.sleep(1.0)
    return tree_cpu_s(worker_pid) - before


def test_a_timed_out_compile_stops_using_cpu(worker):
    proc, stub = worker
    pid = proc.proc.pid
    t0 = time.monotonic()
    call = stub.CompileGrammar.future(request("json_schema", nested_schema(SLOW, "t_")), timeout=2)
    time.sleep(1.0)
    at_work = busy(pid)
    nice = [_nice(p) for p in at_work]
    with pytest.raises(grpc.RpcError) as e:
        call.result()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(max(0.0, t0 + 2.5 - time.monotonic()))
    used = idle_cpu(pid)  # from 0.5 s to 1.5 s past the deadline
    assert used < 0.2, f"the worker and its processes used {used:.2f} s CPU past the deadline"
    assert len(at_work) == 1, "one compile process, not the worker's own threads"
    assert nice[0] >= 10  # below the step loop's priority
    assert state(at_work[0]) is None, f"the compile process {at_work[0]} outlived its deadline"


def test_a_cancelled_compile_is_killed(worker):
    proc, stub = worker
    pid = proc.proc.pid
    call = stub.CompileGrammar.future(request("json_schema", nested_schema(SLOW, "c_")), timeout=60)
    time.sleep(1.0)
    at_work = busy(pid)
    call.cancel()
    t0 = time.monotonic()
    used = idle_cpu(pid)
    assert used < 0.2, f"the worker and its processes used {used:.2f} s CPU in 1 s after a cancel"
    assert len(at_work) == 1 and wait_gone(at_work[0], 0.0) is not None
    assert time.monotonic() - t0 < 1.5


def test_past_the_compile_queue_calls_are_refused_at_once(worker):
    proc, stub = worker
    slow = [request("json_schema", nested_schema(SLOW, f"q{i}_")) for i in range(QUEUE)]
    calls = [stub.CompileGrammar.future(r, timeout=60) for r in slow]
    try:
        time.sleep(1.0)  # all three wait on the worker by now
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.CompileGrammar(request("regex", "[a-z]+!"), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "grammar compiles already waiting" in e.value.details()
        assert "--grammar-compile-queue" in e.value.details()
        assert time.monotonic() - t0 < 1.0
        # The waiting compiles hold threads of their own: other calls still answer.
        t0 = time.monotonic()
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=5).model.architecture == "simulated"
        assert time.monotonic() - t0 < 1.0
    finally:
        for call in calls:
            call.cancel()
    wait_for(lambda: not busy(proc.proc.pid), 2, "the cancelled compiles to go")
    # Refused is no verdict: with room again the same grammar compiles.
    reply = stub.CompileGrammar(request("regex", "[a-z]+!"), timeout=30)
    assert not reply.error and reply.compile_ms > 0


def test_the_compile_processes_die_with_the_worker(tmp_path):
    args = ("--model", "simulated", "--simulated-vocab", "1024", "--grammar-compile-processes", "1")
    proc = WorkerProc(tmp_path, args, "doomed")
    try:
        channel = grpc.insecure_channel(proc.address())
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert not stub.CompileGrammar(request("regex", "warm"), timeout=120).error
        pid = proc.proc.pid
        slow = [request("json_schema", nested_schema(SLOW, f"x{i}_")) for i in range(2)]
        calls = [stub.CompileGrammar.future(r, timeout=60) for r in slow]
        # One process: the first turns slow and pauses for the second, which then runs.
        wait_for(
            lambda: sorted(state(p) for p in busy(pid)) == ["R", "T"], 10, "one running, one paused"
        )
        processes = descendants(pid)  # the zygote and its children, idle ones too
        assert len(processes) >= 3
        proc.proc.kill()  # SIGKILL: no cleanup runs in the worker
        proc.proc.wait()
        # Dead is gone or a zombie: reparented away from the worker, nobody may reap them.
        # Lifelines poll every 0.5 s (common/lifeline.py); a loaded machine
        # can delay a poll by seconds.
        deadline = time.monotonic() + 10.0
        while any(state(p) not in (None, "Z") for p in processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {p: state(p) for p in processes if state(p) not in (None, "Z")}
        assert not left, f"compile processes outlived the worker: {left}"
        for call in calls:
            call.cancel()
        channel.close()
    finally:
        proc.stop()
