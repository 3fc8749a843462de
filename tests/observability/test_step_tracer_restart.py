"""The worker's span process, killed, is reaped and replaced: step spans of
requests that join afterwards reach a real OTLP receiver again (issue 27,
the second hardening round: a SIGKILLed span process stayed a zombie and
the worker made no step span for the rest of its life)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from observability.otlp_receiver import OtlpReceiver
from protos import worker_pb2 as pb
from tests.support.process_tree import read
from worker_service.telemetry.step_tracing import StepTracer

# Starts span processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

BEFORE = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
AFTER = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


def traced_prefill(step_id: int, slot: int, ids: tuple[str, str]) -> pb.StepPlan:
    plan = pb.StepPlan(step_id=step_id, mode=pb.FORWARD_MODE_PREFILL)
    join = plan.joins.add(slot=slot, rid=f"r{slot}")
    join.trace.traceparent = f"00-{ids[0]}-{ids[1]}-01"
    plan.extends.add(slot=slot, start_pos=0, input_ids=[1, 2, 3], sample=True)
    return plan


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_span_process_is_reaped_and_replaced(monkeypatch):
    receiver = OtlpReceiver().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", receiver.protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracer = StepTracer(rank=0)

    def traces() -> set[str]:
        return {s.trace_id for s in receiver.spans()}

    try:
        tracer.step(traced_prefill(1, 0, BEFORE), 10, 20, 0.5)
        assert wait_for(lambda: BEFORE[0] in traces(), 30), "no span before the kill"
        first = tracer._proc.pid
        os.kill(first, signal.SIGKILL)
        # reaped (no zombie left under the worker) and replaced after the backoff
        assert wait_for(lambda: read(first) is None, 5), read(first)
        assert wait_for(lambda: tracer._proc is not None and tracer._proc.pid != first, 5)
        tracer.step(traced_prefill(2, 1, AFTER), 30, 40, 0.5)
        assert wait_for(lambda: AFTER[0] in traces(), 30), "no span after the restart"
        assert tracer.restarts == 1
    finally:
        tracer.close()
        receiver.stop()
