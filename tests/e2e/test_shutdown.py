"""SIGTERM: an idle server exits at once; a busy one drains (stops admitting,
readiness NOT_SERVING, lets its streams finish within --drain-timeout, ends
the rest with UNAVAILABLE); and readiness while the worker group is lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import BIN, greedy, stub, wait_until
from tests.e2e.support.units import NOT_SERVING, SERVING, Unit, health_status, wait_for_file

SIM_WORKER = ["--model", "simulated", "--log-level", "warning"]


def _streams(prefix: str, n: int, tokens: int) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(
            request_id=f"{prefix}{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 1, 7, 8, 9]),
            sampling_params=greedy(tokens, ignore_eos=True),
            stream=True,
        )
        for i in range(n)
    ]


def _hold_kv_subscription(address: str) -> grpc.Channel:
    """Subscribe to KV events as the SMG gateway does (a stream that never
    ends by itself); the channel is returned to keep it open."""
    channel = grpc.insecure_channel(address)
    stream = pb_grpc.SglangSchedulerStub(channel).SubscribeKvEvents(cpb.SubscribeKvEventsRequest())

    def read() -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    return channel


@pytest.mark.parametrize("model", ["simulated", pytest.param("default", marks=pytest.mark.slow)])
def test_an_idle_serve_exits_within_2s_of_sigterm(tmp_path, model):
    """`radixserve serve` after a request, with a KV event subscriber attached
    (the gateway keeps one open): SIGTERM to exit, worker included, < 2 s.
    (It took 5.8 s on the simulated model and 9.2 s on the default one: the
    gRPC server waited its 5 s grace for the subscription to end.)"""
    port_file, log = tmp_path / "serve.port", tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "radixserve"), "serve", "--model", model, "--log-level", "info"]
            + ["--port", "0", "--port-file", str(port_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_file(proc, port_file, log, timeout_s=300)
        address = f"127.0.0.1:{port_file.read_text()}"
        s = stub(address)
        request = pb.GenerateRequest(
            request_id="one",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=greedy(4),
        )
        list(s.Generate(request, timeout=60))
        channel = _hold_kv_subscription(address)
        wait_until(lambda: "KV event subscriber joined" in log.read_text(), 10, "the subscriber")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        elapsed = time.monotonic() - t0
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"{model}: SIGTERM to exit {elapsed:.2f} s")
    assert code == 0, log.read_text()
    # the default model: its worker frees a loaded model at exit (0.5 s when the
    # machine is quiet); a busy shared CI machine gets a margin
    limit = 2.0 if model == "simulated" else 3.0
    assert elapsed < limit, f"{elapsed:.2f} s:\n{log.read_text()[-3000:]}"


def test_sigterm_drains_the_streams_in_flight_and_refuses_new_calls(tmp_path):
    """Scheduler and worker get SIGTERM together mid-stream (a unit restart):
    the streams finish with the tokens of an undisturbed run, new calls end
    UNAVAILABLE, readiness says NOT_SERVING and liveness SERVING meanwhile."""
    unit = Unit(tmp_path, "u", [*SIM_WORKER, "--simulated-step-ms", "20"], [])
    unit.start()
    try:
        baseline = asyncio.run(run_streams(unit.address, _streams("base-", 6, 120)))
        seen: dict = {}

        async def sigterm(progress: list[int]) -> None:
            await wait_for_progress(progress, 6, tokens=5)
            unit.sigterm()
            seen["at"] = list(progress)
            s = stub(unit.address)

            def probe() -> None:
                wait_until(lambda: "draining" in unit.log.read_text(), 10, "the drain")
                seen["ready"] = health_status(f"127.0.0.1:{unit.health_port}")
                seen["live"] = health_status(f"127.0.0.1:{unit.health_port}", "liveness")
                seen["check"] = s.HealthCheck(pb.HealthCheckRequest(), timeout=5)
                late = _streams("late-", 1, 4)[0]
                with pytest.raises(grpc.RpcError) as info:
                    list(s.Generate(late, timeout=10))
                seen["late"] = info.value

            await asyncio.to_thread(probe)

        drained = asyncio.run(run_streams(unit.address, _streams("d-", 6, 120), sigterm))
        _, sched_code, worker_code = unit.wait(30)
    finally:
        unit.kill()
    assert all(0 < n < 120 for n in seen["at"]), seen["at"]
    assert seen["ready"] == NOT_SERVING and seen["live"] == SERVING
    assert not seen["check"].healthy
    assert seen["late"].code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in seen["late"].details()
    for (tokens, reason), (base, base_reason) in zip(drained, baseline, strict=True):
        assert reason == base_reason == "length", reason
        assert tokens == base
    assert (sched_code, worker_code) == (0, 0)
    log = unit.log.read_text()
    assert '"in_flight": 6, "ended": 0' in log, log[-2000:]


def test_past_the_drain_timeout_the_rest_end_unavailable_with_a_message(tmp_path):
    worker = [*SIM_WORKER, "--simulated-step-ms", "20"]
    unit = Unit(tmp_path, "u", worker, ["--drain-timeout", "1"])
    unit.start()
    try:

        async def sigterm(progress: list[int]) -> None:
            await wait_for_progress(progress, 4, tokens=3)
            unit.sigterm()

        t0 = time.monotonic()
        results = asyncio.run(run_streams(unit.address, _streams("long-", 4, 3000), sigterm))
        _, sched_code, worker_code = unit.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        unit.kill()
    for tokens, err in results:
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain ended by --drain-timeout 1 s" in err.details(), err.details()
        assert 0 < len(tokens) < 3000
    assert (sched_code, worker_code) == (0, 0)
    assert elapsed < 20


def test_readiness_is_not_serving_while_the_worker_group_is_lost(tmp_path):
    """Liveness stays SERVING (recovery repairs an outage, a restart would not);
    the HealthCheck RPC answers at once instead of probing a lost worker."""
    unit = Unit(tmp_path, "u", SIM_WORKER, ["--worker-recovery-timeout", "60"])
    unit.start()
    health = f"127.0.0.1:{unit.health_port}"
    try:
        s = stub(unit.address)
        assert health_status(health) == SERVING
        assert health_status(health, "liveness") == SERVING
        assert health_status(unit.address, "sglang.grpc.scheduler.SglangScheduler") == SERVING
        unit.worker.kill()
        unit.worker.wait()
        wait_until(lambda: health_status(health) == NOT_SERVING, 5, "readiness NOT_SERVING")
        assert health_status(unit.address, "sglang.grpc.scheduler.SglangScheduler") == NOT_SERVING
        assert health_status(health, "liveness") == SERVING
        t0 = time.monotonic()
        check = s.HealthCheck(pb.HealthCheckRequest(), timeout=30)
        assert not check.healthy and "worker group is lost" in check.message
        assert time.monotonic() - t0 < 1.0
        # The worker comes back where it was: ready again, with no request needed.
        wfile = tmp_path / "again.port"
        unit.worker = subprocess.Popen(
            [str(BIN / "radixserve-worker"), *SIM_WORKER]
            + ["--port", str(unit.worker_port), "--port-file", str(wfile)]
        )
        wait_until(lambda: health_status(health) == SERVING, 30, "readiness SERVING again")
        assert s.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    finally:
        unit.kill()
