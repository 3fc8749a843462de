"""Worker loss end to end: the worker process is SIGKILLed mid-decode; the
scheduler drops its cache, requeues the requests with what they generated and
resumes them on the worker that comes back (same port), so clients see a
pause, no error, and the tokens of an undisturbed run. Past
--worker-recovery-timeout the streams end with UNAVAILABLE instead."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import BIN, free_port, greedy, process, stub, worker_on_port

pytestmark = pytest.mark.slow

STREAMS = 32


def requests(prefix: str, n: int = STREAMS) -> list[pb.GenerateRequest]:
    topics = ["the sea", "a robot", "Paris", "winter", "a cat", "the moon", "bread", "trains"]
    return [
        pb.GenerateRequest(
            request_id=f"{prefix}{i}",
            tokenized=pb.TokenizedInput(
                original_text=f"Story {i}: once upon a time, {topics[i % 8]} and"
            ),
            sampling_params=greedy(40 + (i * 7) % 25, ignore_eos=True),
            stream=True,
        )
        for i in range(n)
    ]


def test_sigkill_mid_decode_with_32_streams_resumes_with_identical_outputs(tmp_path):
    """The real default model (SmolLM2-135M on CPU), on its float path: a
    resumed stream re-prefills what it had decoded, and identical greedy
    continuations need the recomputation's rounding differences (SDPA against
    the decode kernel) to stay below every logit gap. On the quantized path
    (served by default since issue 33) this test saw a resumed stream differ;
    the likely cause, not proven, is the activations' int8 rounding turning
    such a difference into a whole quantum at a near tie."""
    port = free_port()
    worker_args = ["--model", "default", "--dequantize", "--log-level", "warning"]
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
    sched += ["--log-level", "info", "--worker-recovery-timeout", "120"]
    holder: dict = {}
    with worker_on_port(tmp_path, port, worker_args, "worker") as proc:
        holder["proc"] = proc
        with process(tmp_path, "scheduler", sched) as sport:
            address = f"127.0.0.1:{sport}"
            baseline = asyncio.run(run_streams(address, requests("base-")))
            assert all(reason == "length" for _, reason in baseline), baseline

            async def kill_and_restart(progress: list[int]) -> None:
                # far enough that the re-prefill covers generated tokens too
                await wait_for_progress(progress, STREAMS * 3 // 4, tokens=8)
                holder["proc"].send_signal(signal.SIGKILL)
                holder["proc"].wait()
                holder["tokens_at_kill"] = list(progress)
                await asyncio.sleep(0.5)
                holder["restart"] = worker_on_port(tmp_path, port, worker_args, "worker2")
                holder["proc2"] = await asyncio.to_thread(holder["restart"].__enter__)

            t0 = time.monotonic()
            try:
                disturbed = asyncio.run(run_streams(address, requests("kill-"), kill_and_restart))
            finally:
                if "restart" in holder:
                    holder["restart"].__exit__(None, None, None)
            elapsed = time.monotonic() - t0
    at_kill = holder["tokens_at_kill"]
    assert sum(n > 0 for n in at_kill) >= STREAMS * 3 // 4
    assert any(n < len(base) for n, (base, _) in zip(at_kill, baseline, strict=True)), at_kill
    for (tokens, reason), (base, base_reason) in zip(disturbed, baseline, strict=True):
        assert reason == base_reason == "length", reason
        assert tokens == base
    log = (tmp_path / "scheduler.log").read_text()
    assert "worker group lost" in log and "worker group back" in log
    print(f"disturbed run: {elapsed:.1f} s; tokens at the kill: {at_kill}")


def _sim_worker_args() -> list[str]:
    return ["--model", "simulated", "--simulated-step-ms", "20", "--log-level", "warning"]


def test_past_the_recovery_timeout_streams_end_unavailable_then_service_recovers(tmp_path):
    port = free_port()
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
    metrics = free_port()
    sched += ["--log-level", "info", "--worker-recovery-timeout", "3"]
    sched += ["--metrics-port", str(metrics)]
    reqs = [
        pb.GenerateRequest(
            request_id=f"t{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 1, 2, 3, 4]),
            sampling_params=greedy(400, ignore_eos=True),
            stream=True,
        )
        for i in range(8)
    ]
    with (
        worker_on_port(tmp_path, port, _sim_worker_args(), "worker") as proc,
        process(tmp_path, "scheduler", sched) as sport,
    ):
        address = f"127.0.0.1:{sport}"

        async def kill(progress: list[int]) -> None:
            await wait_for_progress(progress, 8)
            proc.send_signal(signal.SIGKILL)

        t0 = time.monotonic()
        results = asyncio.run(run_streams(address, reqs, kill))
        waited = time.monotonic() - t0
        for tokens, err in results:
            assert isinstance(err, grpc.aio.AioRpcError), err
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker group lost and not back within 3 s" in err.details()
            assert 0 < len(tokens) < 400
        assert waited < 30
        # A request during the outage, past the timeout: UNAVAILABLE at once.
        s = stub(address)
        probe = pb.GenerateRequest(
            request_id="probe",
            tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
            sampling_params=greedy(4),
        )
        with pytest.raises(grpc.RpcError) as info:
            list(s.Generate(probe, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with worker_on_port(tmp_path, port, _sim_worker_args(), "worker2"):
            deadline = time.monotonic() + 30
            while True:
                try:
                    (done,) = list(s.Generate(probe, timeout=30))
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "the service did not come back"
                    time.sleep(0.2)
            assert len(done.complete.output_ids) == 4
            # (while worker2 is up: its exit below is a second loss)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert "radixserve_worker_losses_total 1.0" in text
            assert "radixserve_worker_recoveries_total 1.0" in text


def _child_worker_pid(parent: int) -> int:
    """The worker_service child of ``radixserve serve`` (pid ``parent``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"worker_service" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no worker child of {parent}")


def test_serve_restarts_a_killed_worker_and_the_streams_complete(tmp_path):
    env = {"RADIXSERVE_WORKER_SIMULATED_STEP_MS": "15"}
    args = [str(BIN / "radixserve"), "serve", "--model", "simulated", "--log-level", "info"]
    reqs = [
        pb.GenerateRequest(
            request_id=f"s{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 3, 9, 8, 7, 6]),
            sampling_params=greedy(150, ignore_eos=True),
            stream=True,
        )
        for i in range(8)
    ]
    with process(tmp_path, "serve", args, env=env) as sport:
        address = f"127.0.0.1:{sport}"
        baseline = asyncio.run(run_streams(address, reqs))
        serve_pid = _serve_pid(tmp_path)
        first = _child_worker_pid(serve_pid)

        async def kill(progress: list[int]) -> None:
            await wait_for_progress(progress, 8)
            os.kill(first, signal.SIGKILL)

        reqs2 = [pb.GenerateRequest(**_fields(r, f"k{i}")) for i, r in enumerate(reqs)]
        results = asyncio.run(run_streams(address, reqs2, kill))
        for (tokens, reason), (base, _) in zip(results, baseline, strict=True):
            assert reason == "length", reason
            assert tokens == base
        assert _child_worker_pid(serve_pid) != first
    log = (tmp_path / "serve.log").read_text()
    assert "restarting the worker group" in log and "worker group back" in log


def _fields(req: pb.GenerateRequest, rid: str) -> dict:
    return {
        "request_id": rid,
        "tokenized": req.tokenized,
        "sampling_params": req.sampling_params,
        "stream": req.stream,
    }


def _serve_pid(tmp: Path) -> int:
    """The `radixserve serve` process that process() started (the one with our port file)."""
    marker = str(tmp / "serve.port").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and any(b"radixserve" in c for c in cmdline[:2]):
            return int(entry.name)
    raise AssertionError("radixserve serve is not running")
