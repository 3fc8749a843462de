"""The API process's bound on queued samples (CoreClient) and the core's integrity
switch (Engine), without processes: fake pipe ends stand in for the other side.
What calls meet when the core stops on an internal error: test_core_supervisor.py."""

from __future__ import annotations

import pytest

from scheduler_service import ipc
from scheduler_service.api.core_client import CoreClient, QueueFull
from scheduler_service.config import LimitsConfig, ServiceConfig, load_config
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.intake import Submission
from scheduler_service.core.sampling import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.loop import Engine


class FakeConn:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        return False


def _req(rid: str) -> Submission:
    return Submission(rid, [1, 2, 3], SamplingParams(max_new_tokens=2))


def _core(limit: int) -> CoreClient:
    core = CoreClient(ServiceConfig(limits=LimitsConfig(max_queued_requests=limit)))
    core.attach(FakeConn())
    return core


def _load() -> ipc.Load:
    return ipc.Load(0, 0, 0, 64, 0.0, 0, 0, 0.0, 0.0, 0.0, 8)


def test_samples_count_until_their_first_output_or_until_forgotten():
    core = _core(3)
    a = core.submit([_req("a-0"), _req("a-1")])
    b = core.submit([_req("b")])
    assert core.queued == 3
    with pytest.raises(QueueFull, match=r"the limit \(--max-queued-requests\) is 3"):
        core.submit([_req("c")])
    assert core.find("c") is None  # refused before anything was recorded
    core.dispatch(ipc.Outputs([ipc.DeltaOut(a.rids[0], [5])], _load()))
    core.dispatch(ipc.Outputs([ipc.DeltaOut(a.rids[0], [6])], _load()))  # counted once
    assert core.queued == 2
    core.submit([_req("c")])
    core.forget(a)  # a-1 never started: the call ended (e.g. client cancel)
    core.dispatch(ipc.Rejected(b.rids[0], "bad"))
    assert core.queued == 1
    # health probes are never refused
    core.submit([_req("p1"), _req("p2"), _req("p3")], bounded=False)


def test_a_reused_request_id_never_gets_the_old_calls_outputs():
    core = _core(0)
    old = core.submit([_req("x")])
    with pytest.raises(ValueError, match="already in use"):
        core.submit([_req("x")])
    core.release(old)  # aborted: the id is free at once
    new = core.submit([_req("x")])
    assert old.rids != new.rids and core.find("x") is new
    # the old call's late finish and clean-up stay with it
    core.dispatch(ipc.Outputs([ipc.DeltaOut(old.rids[0], [], finish=ipc.Finish("abort"))], _load()))
    core.forget(old)
    assert new.queue.empty() and core.find("x") is new
    core.dispatch(ipc.Outputs([ipc.DeltaOut(new.rids[0], [7])], _load()))
    assert new.queue.get_nowait().token_ids == [7]


@pytest.mark.parametrize("limit", [0, -1])
def test_zero_or_negative_means_unbounded(limit):
    core = _core(limit)
    for i in range(100):
        core.submit([_req(f"r{i}")])
    assert core.queued == 100


def test_flags_and_environment(monkeypatch):
    cfg = load_config(["--worker", "grpc://w:1", "--max-queued-requests", "-1"])
    assert cfg.limits.max_queued_requests == -1 and not cfg.engine.check_integrity
    assert cfg.limits.max_message_mb == 64
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    monkeypatch.setenv("RADIXSERVE_MAX_MESSAGE_MB", "2")
    cfg = load_config(["--worker", "grpc://w:1"])
    assert cfg.engine.check_integrity and cfg.limits.max_message_mb == 2
    assert cfg.limits.max_queued_requests == 1024


class IdleGroup:
    def open(self) -> None:
        pass

    def ended(self) -> str | None:
        return None  # every stream open


def test_a_broken_invariant_stops_the_core_with_an_internal_failure():
    sched = Scheduler(SchedulerConfig(page_size=4), 16)
    conn = FakeConn()
    engine = Engine(
        sched, IdleGroup(), conn, overlap_depth=1, recovery_timeout_s=60, check_integrity=True
    )
    sched.pool.release([sched.pool._free[0]])  # a double free (the page is already free)
    engine.run()
    (failed,) = [m for m in conn.sent if isinstance(m, ipc.Failed)]
    assert failed.code == "INTERNAL"
    assert "scheduler integrity check failed after a step" in failed.message
