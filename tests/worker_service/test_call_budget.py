"""The worker's thread budget on its own: the unopened Execute streams (the
oldest waiter gives way to a newer stream) and the bounded methods, behind
the real interceptor on a real gRPC server."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_service.rpc.call_budget import (
    ADAPTER_LOADS,
    EVICTED,
    TOKENIZER_STREAMS,
    UnopenedStreams,
    worker_threads,
)
from worker_service.rpc.call_guard import WorkerCallGuard
from worker_service.rpc.server import SERVICE_NAME
from worker_service.telemetry.metrics import WorkerMetrics


def test_a_new_stream_takes_the_place_of_the_oldest_waiting_one():
    streams = UnopenedStreams(2)
    plans = [queue.SimpleQueue() for _ in range(4)]
    first, second = streams.enter(plans[0]), streams.enter(plans[1])
    third = streams.enter(plans[2])  # the first gives way
    assert plans[0].get_nowait() is EVICTED and plans[1].empty()
    assert not streams.opened(first)  # its opening, if it comes now, is too late
    assert streams.opened(second) and streams.opened(third)
    assert streams.enter(plans[3]) is None  # both have their openings: nobody gives way
    streams.leave(first)  # an evicted stream leaving frees nothing twice
    assert streams.held == 2
    streams.leave(second)
    assert streams.enter(plans[3]) is not None


class _Slow(worker_pb2_grpc.WorkerServicer):
    """LoadAdapter and GetTokenizer that take until released (an adapter on
    a stalled disk, a caller that stops reading)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def GetInfo(self, request, context):
        return pb.WorkerInfo(page_size=16)

    def LoadAdapter(self, request, context):
        self.release.wait(30)
        return pb.LoadAdapterResponse(rank=8)

    def GetTokenizer(self, request, context) -> Iterator[pb.TokenizerChunk]:
        self.release.wait(30)
        yield pb.TokenizerChunk(data=b"zip")


@pytest.fixture
def slow_worker():
    servicer = _Slow()
    metrics = WorkerMetrics(lambda: 0, 8)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=worker_threads(16)),
        interceptors=[WorkerCallGuard(SERVICE_NAME, None, metrics)],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, worker_pb2_grpc.WorkerStub(channel), metrics
    finally:
        servicer.release.set()
        channel.close()
        server.stop(None)


def _call(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_slow_calls_past_their_bound_are_refused_at_once(slow_worker):
    servicer, stub, metrics = slow_worker
    n_load, n_tok = ADAPTER_LOADS + 3, TOKENIZER_STREAMS + 3
    load = lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="a"), timeout=30)  # noqa: E731
    tok = lambda: list(stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=30))  # noqa: E731
    with ThreadPoolExecutor(n_load + n_tok) as pool:
        t0 = time.monotonic()
        calls = [pool.submit(_call, load) for _ in range(n_load)]
        calls += [pool.submit(_call, tok) for _ in range(n_tok)]
        time.sleep(0.5)
        refused = [c.result() for c in calls if c.done()]
        refused_s = time.monotonic() - t0
        get_info_t0 = time.monotonic()
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=5).page_size == 16
        get_info_s = time.monotonic() - get_info_t0
        servicer.release.set()
        answered = [c.result() for c in calls]
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6 and refused_s < 1
    assert get_info_s < 0.1
    assert answered.count(grpc.StatusCode.OK) == ADAPTER_LOADS + TOKENIZER_STREAMS
    counted = {
        (s.labels["method"], s.labels["code"]): s.value
        for m in metrics.collect()
        if m.name == "radixserve_worker_request_errors"
        for s in m.samples
    }
    assert counted == {
        ("GetTokenizer", "RESOURCE_EXHAUSTED"): 3,
        ("LoadAdapter", "RESOURCE_EXHAUSTED"): 3,
    }
    # the slots were given back
    assert _call(load) == grpc.StatusCode.OK
    assert _call(tok) == grpc.StatusCode.OK


def test_the_core_sends_no_more_adapter_loads_than_a_worker_takes():
    """The scheduler's core keeps at most the worker's bound of LoadAdapter
    calls in flight (past it the worker refuses them)."""
    from scheduler_service.engine.adapter_loader import MAX_LOADS_IN_FLIGHT

    assert MAX_LOADS_IN_FLIGHT == ADAPTER_LOADS
