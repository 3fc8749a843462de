"""A session opening the worker takes only after the scheduler stopped
waiting for it does not lock that scheduler out (issue 27, the second
hardening round).

A real (simulated) worker in a long step holds its step lock; the
scheduler's opening waits behind it, the scheduler gives up (the opening
deadline), and the worker takes the abandoned opening once the step ends.
The scheduler used to open again with the same epoch, which the worker then
refused as stale ("held by session <its own id>") on every retry until the
worker restarted: its requests ended at the recovery timeout and new ones
failed for good. It must open above it instead."""

from __future__ import annotations

import time

import pytest

from protos import worker_pb2 as pb
from scheduler_service.engine import worker_group
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup
from tests.worker_service.support.worker_process import worker_processes

# Starts a simulated worker process (tests/support/process_guard.py).
pytestmark = pytest.mark.server

STEP_S = 3.0


def _slow_step() -> pb.StepPlan:
    plan = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    plan.joins.add(slot=0, rid="r", prompt_len=3, sampling=pb.SamplingParams(temperature=0.0))
    plan.extends.add(slot=0, start_pos=0, input_ids=[1, 2, 3], new_pages=[0], sample=True)
    return plan


def test_an_opening_taken_after_the_scheduler_gave_up_does_not_lock_it_out(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_group, "OPEN_TIMEOUT_S", 0.5)
    args = ("--model", "simulated", "--simulated-step-ms", str(STEP_S * 1000))
    with worker_processes(tmp_path, (*args, "--log-level", "info")) as (address,):
        group = WorkerGroup([f"grpc://{address}"])
        try:
            group.connect(timeout_s=60)
            group.open()
            group.send(_slow_step())  # the worker holds its step lock for STEP_S
            time.sleep(0.3)
            group.drop_streams()  # as after a loss: a new session must take over
            group.try_connect()
            with pytest.raises(
                WorkerError, match=r"within 0\.5 s, waiting for the session opening"
            ):
                group.open()
            # The worker takes that abandoned opening when its step ends; the
            # scheduler retries (as recovery does) and must get in.
            deadline = time.monotonic() + STEP_S + 10
            errors: list[str] = []
            while True:
                group.drop_streams()
                group.try_connect()
                try:
                    group.open()
                    break
                except WorkerError as e:
                    errors.append(str(e))
                assert time.monotonic() < deadline, errors[-3:]
                time.sleep(0.2)
            assert not any("stale" in e for e in errors), errors
        finally:
            group.close()
