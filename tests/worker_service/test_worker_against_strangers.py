"""A token-less worker process (as `radixserve serve` runs it by default)
against strangers on its port: bad session epochs, Execute streams that never
open or never read, bytes that do not parse. None of them may change the
worker's state or keep its gRPC threads from the scheduler."""

from __future__ import annotations

import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.e2e.support.system import free_port
from tests.worker_service.support.raw_plans import negative_epoch_opening
from tests.worker_service.support.worker_process import PlanStream, WorkerProc, next_epoch

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

SERVICE = "/radixserve.worker.v1.Worker/"
TOP = "above the protocol's maximum 9223372036854775807 (2**63 - 1)"
AHEAD = "more than 2**40 ns (18.3 min) ahead of"


class _Worker:
    def __init__(self, address: str, metrics_port: int, log: Path) -> None:
        self.address = address
        self.metrics_port = metrics_port
        self.log = log
        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def raw(self, method: str, data: bytes, **kw) -> grpc.RpcError:
        """A unary call of raw bytes; the error it ends with."""
        call = self.channel.unary_unary(SERVICE + method)
        with pytest.raises(grpc.RpcError) as info:
            call(data, timeout=10, **kw)
        return info.value

    def refused(self) -> dict[tuple[str, str], float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return {
            (s.labels["method"], s.labels["code"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "radixserve_worker_request_errors"
            for s in family.samples
            if s.name.endswith("_total")
        }


def _start(tmp: Path, name: str, *args: str) -> tuple[WorkerProc, _Worker]:
    metrics = free_port()
    proc = WorkerProc(tmp, ("--model", "simulated", "--metrics-port", str(metrics), *args), name)
    try:
        return proc, _Worker(proc.address(), metrics, proc.log_path)
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
        "negative": (negative_epoch_opening(), "session epoch 18446744073709551615 is " + TOP),
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


def _silent(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until released."""
    release.wait(30)
    yield from ()


def test_silent_streams_leave_threads_for_get_info_and_the_scheduler(worker):
    """Ten Execute streams that never send their opening held all 8 gRPC
    threads for 10 s: GetInfo waited 9 s and no scheduler could open."""
    n = 10
    open_streams = worker.channel.stream_stream(SERVICE + "Execute")
    release = threading.Event()

    def silent_stream() -> tuple[grpc.StatusCode, str, float]:
        t0 = time.monotonic()
        try:
            list(open_streams(_silent(release), timeout=30))
        except grpc.RpcError as e:
            return e.code(), e.details(), time.monotonic() - t0
        raise AssertionError("a silent stream was accepted")

    with ThreadPoolExecutor(n) as pool:
        try:
            ends = [pool.submit(silent_stream) for _ in range(n)]
            time.sleep(0.5)  # every stream has reached the worker
            t0 = time.monotonic()
            info = worker.stub.GetInfo(pb.GetInfoRequest(), timeout=5)
            get_info_s = time.monotonic() - t0
            t0 = time.monotonic()
            session = PlanStream(worker.address, "scheduler", epoch=info.session_epoch + 1)
            open_s = time.monotonic() - t0
            session.close()
            results = [f.result() for f in ends]
        finally:
            release.set()
    assert get_info_s < 0.1, get_info_s
    assert open_s < 0.5, open_s
    # Each newer stream took the place of the oldest silent one, which was
    # refused at once; the last four (the scheduler's took a fifth's place)
    # ran out of time.
    evicted = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    timed_out = [r for r in results if r[0] == grpc.StatusCode.INVALID_ARGUMENT]
    assert len(evicted) == 7 and len(timed_out) == 3, results
    assert all("a newer stream took this one's place" in d for _, d, _ in evicted)
    assert all("no opening message within 3 s" in d for _, d, _ in timed_out)
    assert all(2.5 < s < 5 for _, _, s in timed_out), timed_out
    print(f"GetInfo {get_info_s * 1e3:.1f} ms, a session opened in {open_s * 1e3:.1f} ms")


def _stuffed_session(address: str, epoch: int, plans: int) -> tuple[grpc.Channel, object]:
    """A stranger's session that sends ``plans`` idle plans and reads none of
    their results: once they fill the stream's flow-control window, the
    worker's thread sending them is stuck."""
    # A small receive window (1 KiB) fills with a few hundred results.
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    channel = grpc.insecure_channel(
        address, options=[*small_window, ("grpc.use_local_subchannel_pool", 1)]
    )
    stream: queue.SimpleQueue = queue.SimpleQueue()
    stream.put(pb.StepPlan(session=pb.SessionOpen(session_id="stuffer", epoch=epoch)))
    for i in range(plans):
        stream.put(pb.StepPlan(step_id=i + 1, mode=pb.FORWARD_MODE_IDLE))
    call = worker_pb2_grpc.WorkerStub(channel).Execute(iter(stream.get, None), timeout=20)
    next(call)  # the session is open; nothing more is read
    return channel, call


@pytest.mark.slow
def test_replaced_sessions_that_read_nothing_do_not_keep_their_threads(worker):
    """Sessions replaced while stuck sending results held a gRPC thread each,
    for good: eight of them (seven replaced, one active) left no thread for
    anything. Now a replaced one is cancelled after REPLACED_GRACE_S."""
    held = []
    epoch = max(next_epoch(), worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).session_epoch)
    cancelled = "replaced Execute stream does not read its results: cancelled"
    before = worker.log.read_text().count(cancelled)
    try:
        for i in range(8):
            held.append(_stuffed_session(worker.address, epoch + i + 1, 300))
            time.sleep(0.2)  # the worker runs the plans and fills the window
        t0 = time.monotonic()
        worker.stub.GetInfo(pb.GetInfoRequest(), timeout=5)
        get_info_s = time.monotonic() - t0
    finally:
        for channel, call in held:
            call.cancel()
            channel.close()
    assert get_info_s < 0.1, get_info_s
    assert worker.log.read_text().count(cancelled) - before == 7


def test_undecodable_bodies_answer_invalid_argument_logged_and_counted(worker):
    garbage = b"\xff\xfe\xfd garbage"
    for method, message in (
        ("GetInfo", "GetInfoRequest"),
        ("LoadAdapter", "LoadAdapterRequest"),
        ("UnloadAdapter", "UnloadAdapterRequest"),
        ("CompileGrammar", "CompileGrammarRequest"),
    ):
        e = worker.raw(method, garbage)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e)
        expected = f"the request (11 bytes) does not parse as radixserve.worker.v1.{message}: "
        assert e.details().startswith(expected), e.details()
    tokenizer = worker.channel.unary_stream(SERVICE + "GetTokenizer")
    with pytest.raises(grpc.RpcError) as info:
        list(tokenizer(garbage, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "radixserve.worker.v1.GetTokenizerRequest" in info.value.details()
    refused = worker.refused()
    for method in ("GetInfo", "LoadAdapter", "UnloadAdapter", "CompileGrammar", "GetTokenizer"):
        assert refused[(method, "INVALID_ARGUMENT")] >= 1, refused
    log = worker.log.read_text()
    assert log.count('"undecodable request refused"') >= 5
    assert '"method": "GetTokenizer", "bytes": 11' in log
    # the worker still serves
    assert worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).page_size > 0


def test_garbage_without_the_token_is_still_unauthenticated(tmp_path):
    token = tmp_path / "token"
    token.write_text("the-token\n")
    proc, w = _start(tmp_path, "tw", "--worker-token-file", str(token))
    try:
        e = w.raw("GetInfo", b"\xff\xfe garbage")
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        e = w.raw("GetInfo", b"\xff\xfe garbage", metadata=(("authorization", "Bearer the-token"),))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert w.refused() == {
            ("GetInfo", "UNAUTHENTICATED"): 1.0,
            ("GetInfo", "INVALID_ARGUMENT"): 1.0,
        }
    finally:
        w.channel.close()
        proc.stop()
