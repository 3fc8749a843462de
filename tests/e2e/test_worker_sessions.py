"""Fenced worker sessions end to end: strangers cannot take a worker over, a
newer scheduler can, and a replaced one never comes back.

Before sessions, any Execute stream on a worker's port reset it and replaced
the scheduler's stream (even one whose first message did not parse), so every
such call cost the scheduler a worker loss and a re-prefill of everything."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc
from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import (
    BIN,
    free_port,
    greedy,
    process,
    scrape_metric,
    stub,
    worker_on_port,
)

pytestmark = pytest.mark.slow

EXECUTE = "/radixserve.worker.v1.Worker/Execute"
TOKEN = "s3cret-worker-token"


def _sim_worker(*extra: str) -> list[str]:
    return ["--model", "simulated", "--simulated-step-ms", "15", "--log-level", "info", *extra]


def _streams(prefix: str, n: int = 6, tokens: int = 120) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(
            request_id=f"{prefix}{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 7, 5, 3, 1, 2]),
            sampling_params=greedy(tokens, ignore_eos=True),
            stream=True,
        )
        for i in range(n)
    ]


def _raw_execute(address: str, messages: list[bytes], token: str | None) -> grpc.RpcError:
    """An Execute stream of raw bytes; the error it ends with."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(EXECUTE)(
            iter(messages),
            metadata=(("authorization", f"Bearer {token}"),) if token else None,
            timeout=20,
        )
        try:
            got = list(call)
        except grpc.RpcError as e:
            return e
    raise AssertionError(f"the stream was accepted: {got}")


def _opening(epoch: int, session_id: str = "intruder") -> bytes:
    opening = wpb.SessionOpen(session_id=session_id, epoch=epoch)
    return wpb.StepPlan(session=opening).SerializeToString()


def _intrusions(address: str) -> list[tuple[str, grpc.StatusCode, str]]:
    """Every kind of stranger's Execute stream, with what it was answered."""
    far_future = time.time_ns() * 2
    plan = wpb.StepPlan(step_id=1, mode=wpb.FORWARD_MODE_IDLE).SerializeToString()
    cases = [
        ("garbage bytes", [b"\xff\xfe\xfd garbage \x00\x01"], TOKEN),
        ("no opening message", [], TOKEN),
        ("a plan instead of an opening", [plan], TOKEN),
        ("an opening with a plan in it", [plan + _opening(far_future)], TOKEN),
        ("an opening without a session id", [_opening(far_future, "")], TOKEN),
        ("no token", [_opening(far_future)], None),
        ("a wrong token", [_opening(far_future)], "not-the-token"),
        ("a stale epoch", [_opening(1)], TOKEN),
    ]
    out = []
    for name, messages, token in cases:
        e = _raw_execute(address, messages, token)
        out.append((name, e.code(), e.details()))
    return out


def test_strangers_streams_are_refused_and_cost_the_scheduler_nothing(tmp_path: Path):
    token_file = tmp_path / "worker.token"
    token_file.write_text(TOKEN + "\n")
    wport, metrics = free_port(), free_port()
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
    sched += ["--worker-token-file", str(token_file), "--metrics-port", str(metrics)]
    worker = _sim_worker("--worker-token-file", str(token_file))
    with (
        worker_on_port(tmp_path, wport, worker, "worker"),
        process(tmp_path, "scheduler", sched) as sport,
    ):
        address, waddress = f"127.0.0.1:{sport}", f"127.0.0.1:{wport}"
        t0 = time.monotonic()
        baseline = asyncio.run(run_streams(address, _streams("base-")))
        undisturbed = time.monotonic() - t0
        assert all(reason == "length" for _, reason in baseline), baseline
        answers: list = []

        async def intrude(progress: list[int]) -> None:
            await wait_for_progress(progress, len(progress), tokens=5)
            for _ in range(3):  # 24 strangers' streams while the streams run
                answers.extend(await asyncio.to_thread(_intrusions, waddress))

        t0 = time.monotonic()
        disturbed = asyncio.run(run_streams(address, _streams("dist-"), intrude))
        elapsed = time.monotonic() - t0
        assert [t for t, _ in disturbed] == [t for t, _ in baseline]
        assert all(reason == "length" for _, reason in disturbed), disturbed
        assert scrape_metric(metrics, "radixserve_worker_losses_total") == 0
        assert scrape_metric(metrics, "radixserve_worker_recoveries_total") == 0
        # the API process's own worker channel (grammars) carries the token too
        regex = pb.GenerateRequest(
            request_id="digits",
            tokenized=pb.TokenizedInput(input_ids=[1, 2]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=10, regex="[0-9]{3}"),
        )
        (done,) = list(stub(address).Generate(regex, timeout=60))
        assert bytes(t for t in done.complete.output_ids if t < 256).decode().isdigit()
        # the other RPCs want the token as well
        with grpc.insecure_channel(waddress) as ch:
            w = worker_pb2_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                w.GetInfo(wpb.GetInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                w.UnloadAdapter(wpb.UnloadAdapterRequest(name="x"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            meta = (("authorization", f"Bearer {TOKEN}"),)
            assert w.GetInfo(wpb.GetInfoRequest(), timeout=10, metadata=meta).session_epoch > 0
    codes = {name: (code, details) for name, code, details in answers}
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert codes["garbage bytes"][0] == invalid
    assert "does not parse" in codes["garbage bytes"][1]
    assert codes["no opening message"][0] == invalid
    assert codes["a plan instead of an opening"][0] == invalid
    assert "must open with StepPlan.session" in codes["a plan instead of an opening"][1]
    assert codes["an opening with a plan in it"][0] == invalid
    assert codes["an opening without a session id"][0] == invalid
    assert codes["no token"][0] == grpc.StatusCode.UNAUTHENTICATED
    assert codes["a wrong token"][0] == grpc.StatusCode.UNAUTHENTICATED
    assert codes["a stale epoch"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale scheduler session" in codes["a stale epoch"][1]
    assert len(answers) == 24
    print(f"undisturbed run {undisturbed:.1f} s; with 24 refused streams {elapsed:.1f} s")


def test_a_new_scheduler_takes_over_and_the_replaced_one_stays_out(tmp_path: Path):
    """Scheduler A serves; B starts on the same worker (a restart whose old
    process lingers): B takes over at once, A's streams end UNAVAILABLE past
    its recovery timeout, and A's reconnect attempts (a stale epoch) never
    disturb B."""
    wport = free_port()
    worker = ["--worker", f"grpc://127.0.0.1:{wport}"]
    a_cmd = [str(BIN / "radixserve-scheduler"), *worker, "--worker-recovery-timeout", "3"]
    # No drafts: A's second run would draft the baseline's cached answers and
    # finish before B has started.
    a_cmd.append("--no-speculative-ngram")
    b_metrics = free_port()
    b_cmd = [str(BIN / "radixserve-scheduler"), *worker, "--metrics-port", str(b_metrics)]
    with (
        worker_on_port(tmp_path, wport, _sim_worker(), "worker"),
        process(tmp_path, "sched-a", a_cmd) as a_port,
    ):
        a_address = f"127.0.0.1:{a_port}"
        baseline = asyncio.run(run_streams(a_address, _streams("base-", tokens=300)))
        started: dict = {}

        def start_b() -> None:
            started["b"] = process(tmp_path, "sched-b", b_cmd)
            started["port"] = started["b"].__enter__()

        async def take_over(progress: list[int]) -> None:
            await wait_for_progress(progress, len(progress), tokens=5)
            thread = threading.Thread(target=start_b)
            thread.start()
            await asyncio.to_thread(thread.join)

        try:
            on_a = asyncio.run(run_streams(a_address, _streams("a-", tokens=300), take_over))
            for _, err in on_a:
                assert isinstance(err, grpc.aio.AioRpcError), err
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "worker group lost and not back within 3 s" in err.details()
            b_address = f"127.0.0.1:{started['port']}"
            t0 = time.monotonic()
            on_b = asyncio.run(run_streams(b_address, _streams("b-", tokens=300)))
            assert time.monotonic() - t0 > 4  # A kept trying meanwhile
            assert [t for t, _ in on_b] == [t for t, _ in baseline]
            assert scrape_metric(b_metrics, "radixserve_worker_losses_total") == 0
            # A still cannot serve: its requests fail, B's worker is untouched
            with pytest.raises(grpc.RpcError) as info:
                probe = pb.GenerateRequest(
                    request_id="probe",
                    tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                    sampling_params=greedy(3),
                )
                list(stub(a_address).Generate(probe, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert scrape_metric(b_metrics, "radixserve_worker_losses_total") == 0
        finally:
            if "b" in started:
                started["b"].__exit__(None, None, None)
    a_log = (tmp_path / "sched-a.log").read_text()
    assert "is held by a newer scheduler session" in a_log
    assert "stale scheduler session" in a_log
    worker_log = (tmp_path / "worker.log").read_text()
    assert "Execute stream refused" in worker_log


def test_a_strangers_epoch_at_the_top_of_the_range_does_not_brick_the_worker(tmp_path: Path):
    """One SessionOpen(epoch = 2**64 - 1) was accepted, and every scheduler
    started afterwards failed in its core (ValueError: Value out of range:
    18446744073709551616), every call INTERNAL, until the worker restarted."""
    wport = free_port()
    waddress = f"127.0.0.1:{wport}"
    answers = {}
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://{waddress}"]
    with worker_on_port(tmp_path, wport, _sim_worker(), "worker"):
        with grpc.insecure_channel(waddress) as ch:
            execute = ch.stream_stream(EXECUTE)
            for epoch in (2**64 - 1, 2**63, 2**63 - 1):
                try:
                    got = list(execute(iter([_opening(epoch)]), timeout=5))
                    answers[epoch] = f"accepted: {got}"
                except grpc.RpcError as e:
                    answers[epoch] = e.code()
        with process(tmp_path, "scheduler", sched) as sport:
            request = pb.GenerateRequest(
                request_id="after",
                tokenized=pb.TokenizedInput(input_ids=[7, 5, 3]),
                sampling_params=greedy(5, ignore_eos=True),
            )
            (done,) = list(stub(f"127.0.0.1:{sport}").Generate(request, timeout=60))
            assert len(done.complete.output_ids) == 5
    assert set(answers.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, answers


class _WorkerAtTheTop(worker_pb2_grpc.WorkerServicer):
    def GetInfo(self, request, context):
        return wpb.WorkerInfo(
            protocol_version=3,
            page_size=16,
            num_pages=64,
            tp_size=1,
            model=wpb.ModelInfo(name="top", vocab_size=512),
            session_epoch=2**64 - 1,
        )


def test_a_scheduler_stops_at_start_on_a_worker_it_cannot_open_above(tmp_path: Path):
    """A worker (of any make) that reports an epoch no session can go above
    is refused by name, not turned into a core that fails every call."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(_WorkerAtTheTop(), server)
    wport = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
    try:
        with (
            pytest.raises(RuntimeError, match="exited") as info,
            process(tmp_path, "scheduler", sched, timeout_s=60),
        ):
            pass
    finally:
        server.stop(None)
    assert (
        f"worker 127.0.0.1:{wport} reports session epoch 18446744073709551615, at or above the "
        "protocol's maximum 9223372036854775807 (2**63 - 1), so no session can open above it: "
        "restart that worker"
    ) in str(info.value)
