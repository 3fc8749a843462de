"""A token-less worker process (as `radixserve serve` runs it by default)
against strangers on its port: bad session epochs. None of them may change
the worker's state."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.worker_service.test_sessions import _negative_epoch_opening
from tests.worker_service.worker_process import PlanStream, WorkerProc, next_epoch

SERVICE = "/radixserve.worker.v1.Worker/"
TOP = "above the protocol's maximum 9223372036854775807 (2**63 - 1)"
AHEAD = "more than 2**40 ns (18.3 min) ahead of"


class _Worker:
    def __init__(self, address: str, log: Path) -> None:
        self.address = address
        self.log = log
        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)


def _start(tmp: Path, name: str, *args: str) -> tuple[WorkerProc, _Worker]:
    proc = WorkerProc(tmp, ("--model", "simulated", *args), name)
    try:
        return proc, _Worker(proc.address(), proc.log_path)
    except BaseException:
        proc.stop()
        raise


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[_Worker]:
    proc, w = _start(tmp_path_factory.mktemp("worker"), "w", "--log-level", "info")
    try:
        yield w
    finally:
        w.channel.close()
        proc.stop()


def _opening(epoch: int) -> bytes:
    return pb.StepPlan(
        session=pb.SessionOpen(session_id="stranger", epoch=epoch)
    ).SerializeToString()


def _execute(w: _Worker, messages: list[bytes]) -> grpc.RpcError:
    call = w.channel.stream_stream(SERVICE + "Execute")(iter(messages), timeout=20)
    try:
        got = list(call)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"the stream was accepted: {got}")


def test_bad_session_epochs_are_refused_before_anything_changes(worker):
    session = PlanStream(worker.address, "scheduler")  # a scheduler holds the worker
    before = worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).session_epoch
    cases = {
        "2**64 - 1": (_opening(2**64 - 1), TOP),
        "2**63": (_opening(2**63), TOP),
        # in range, but the worker would never accept a scheduler again
        "2**63 - 1": (_opening(2**63 - 1), AHEAD),
        "an hour ahead": (_opening(time.time_ns() + 3600 * 10**9), AHEAD),
        "0": (_opening(0), "the session epoch must be > 0"),
        # an int64 -1 on the wire arrives as 2**64 - 1 (uint64 varints wrap)
        "negative": (_negative_epoch_opening(), "session epoch 18446744073709551615 is " + TOP),
    }
    for name, (opening, says) in cases.items():
        e = _execute(worker, [opening])
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert says in e.details(), (name, e.details())
    assert worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).session_epoch == before
    # the scheduler's session was not touched, and the next scheduler opens as usual
    idle = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
    assert not session.run(idle).error
    session.close()
    after = PlanStream(worker.address, "next scheduler", epoch=max(next_epoch(), before + 1))
    assert not after.run(idle).error
    after.close()
