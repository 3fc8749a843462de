"""A step much bigger than the usual ones is given the time its tokens take,
not declared hung at the deadline of the usual ones (issue 27, second
hardening round: a prompt at the context limit took one 190 s prefill step
on 2 busy CPU cores; at the 60 s floor the group was dropped, re-prefilled
and dropped again, every other request with it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.engine import step_deadline
from scheduler_service.engine.worker_group import WorkerGroup

S_PER_TOKEN = 0.001  # the stand-in worker's speed


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Takes S_PER_TOKEN a token of each plan (its prefill inputs)."""

    def GetInfo(self, request, context):
        return pb.WorkerInfo(
            protocol_version=3, page_size=16, num_pages=8, tp_size=1, model=pb.ModelInfo()
        )

    def Execute(self, request_iterator, context) -> Iterator[pb.StepResult]:
        for plan in request_iterator:
            time.sleep(S_PER_TOKEN * sum(len(e.input_ids) for e in plan.extends))
            yield pb.StepResult(step_id=plan.step_id)


def _plan(step_id: int, tokens: int) -> pb.StepPlan:
    plan = pb.StepPlan(step_id=step_id, mode=pb.FORWARD_MODE_PREFILL)
    plan.extends.add(slot=0, input_ids=[1] * tokens)
    return plan


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setattr(step_deadline, "FLOOR_S", 0.3)
    monkeypatch.setattr(step_deadline, "FACTOR", 2.0)
    monkeypatch.setattr(step_deadline, "PRIOR_S_PER_TOKEN", 0.0005)  # half the worker's speed
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    g = WorkerGroup([f"grpc://127.0.0.1:{port}"])
    g.connect(timeout_s=10)
    g.open()
    try:
        yield g
    finally:
        g.close()
        server.stop(None)


def test_a_big_step_is_not_declared_hung_at_the_usual_steps_deadline(group):
    step = 0
    for _ in range(step_deadline.RECOMPUTE_EVERY):  # the usual steps: 40 tokens, 40 ms
        step += 1
        group.send(_plan(step, 40))
        group.receive(40)
    usual = group.deadline.current_s
    assert usual < 1.5  # what a usual step gets
    group.send(_plan(step + 1, 2000))  # 2 s: past it
    t0 = time.monotonic()
    assert group.receive(2000).step_id == step + 1
    assert time.monotonic() - t0 > usual
