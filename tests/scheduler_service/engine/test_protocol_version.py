"""A worker of another protocol version (an older one) is refused with
a message that says what to do, not left to fail on its first stream."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup


class _OldWorker(worker_pb2_grpc.WorkerServicer):
    def GetInfo(self, request, context):
        return pb.WorkerInfo(
            protocol_version=2, page_size=16, num_pages=8, tp_size=1, model=pb.ModelInfo()
        )


def test_a_worker_of_protocol_1_is_refused_at_connect():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServicer_to_server(_OldWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    group = WorkerGroup([f"grpc://127.0.0.1:{port}"])
    try:
        with pytest.raises(WorkerError, match="speaks worker protocol 2, this scheduler 3"):
            group.connect(timeout_s=10)
    finally:
        group.close()
        server.stop(None)
