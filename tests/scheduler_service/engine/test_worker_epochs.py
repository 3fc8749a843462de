"""A worker that reports a session epoch the scheduler cannot open above is
refused by name, like a worker of another protocol version: the scheduler
used to compute "highest + 1" into the uint64 field and fail in its core
(ValueError: Value out of range), and every call got INTERNAL."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from common.session_epoch import MAX_SESSION_EPOCH
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Reports ``epoch`` as its highest; acknowledges every session opening."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.opened: list[int] = []

    def GetInfo(self, request, context):
        return pb.WorkerInfo(
            protocol_version=3,
            page_size=16,
            num_pages=8,
            tp_size=1,
            model=pb.ModelInfo(vocab_size=32),
            session_epoch=self.epoch,
        )

    def Execute(self, request_iterator, context) -> Iterator[pb.StepResult]:
        opening = next(request_iterator)
        self.opened.append(opening.session.epoch)
        yield pb.StepResult(step_id=opening.step_id)


@pytest.fixture
def worker():
    servicer = _Worker(0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    group = WorkerGroup([f"grpc://127.0.0.1:{port}"])
    try:
        yield servicer, group, f"127.0.0.1:{port}"
    finally:
        group.close()
        server.stop(None)


@pytest.mark.parametrize("epoch", [2**64 - 1, 2**63, MAX_SESSION_EPOCH])
def test_a_worker_at_the_top_of_the_epoch_range_is_refused_by_name(worker, epoch):
    servicer, group, address = worker
    servicer.epoch = epoch
    expected = (
        f"worker {address} reports session epoch {epoch}, at or above the protocol's maximum "
        f"{MAX_SESSION_EPOCH} (2**63 - 1), so no session can open above it: restart that worker"
    )
    with pytest.raises(WorkerError) as info:  # a starting scheduler stops with this
        group.connect(timeout_s=10)
    assert str(info.value) == expected
    with pytest.raises(WorkerError) as info:  # a reconnecting one logs it and retries
        group.try_connect()
    assert str(info.value) == expected


def test_an_epoch_past_the_maximum_is_never_sent(worker):
    servicer, group, _ = worker
    servicer.epoch = MAX_SESSION_EPOCH - 1  # one session left below the maximum
    group.connect(timeout_s=10)
    group.open()
    assert servicer.opened == [MAX_SESSION_EPOCH]
    group.drop_streams()
    group.try_connect()
    with pytest.raises(WorkerError, match="next session epoch 9223372036854775808 is above"):
        group.open()
    assert servicer.opened == [MAX_SESSION_EPOCH]
