"""A flapping worker: it comes back, the scheduler reconnects, and it dies
again, over and over. The recovery clock runs from the first loss until the
group has stayed up for a while, so the requests end UNAVAILABLE once
--worker-recovery-timeout has passed, however often the worker reconnects.
Before, every reconnect restarted the clock and the requests waited as long
as the flapping went on."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.streams import wait_for_progress
from tests.e2e.support.system import BIN, free_port, greedy, process

pytestmark = pytest.mark.slow

WORKER = ["--model", "simulated", "--simulated-step-ms", "20", "--log-level", "info"]
TIMEOUT_S = 4
KILLS = 6


def _start_workers(tmp: Path, port: int, n: int) -> list[tuple[subprocess.Popen, Path]]:
    """``n`` workers all listening on ``port`` (SO_REUSEPORT): each time the
    one the scheduler uses dies, it reconnects to one of the others at once."""
    started = []
    for i in range(n):
        log = tmp / f"w{i}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [str(BIN / "radixserve-worker"), *WORKER, "--port", str(port)]
                + ["--port-file", str(tmp / f"w{i}.port")],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append((proc, log))
    deadline = time.monotonic() + 180
    for i, (proc, log) in enumerate(started):
        while not ((tmp / f"w{i}.port").exists() and (tmp / f"w{i}.port").read_text()):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    return started


async def _next_session(workers: list, used: set[int], timeout_s: float = 30) -> int:
    """The worker the scheduler opened its next session on."""
    deadline = time.monotonic() + timeout_s
    while True:
        for i, (proc, log) in enumerate(workers):
            if i not in used and proc.poll() is None and "session opened" in log.read_text():
                used.add(i)
                return i
        assert time.monotonic() < deadline, "the scheduler did not reconnect"
        await asyncio.sleep(0.05)


def test_a_flapping_worker_fails_the_requests_at_the_recovery_timeout(tmp_path: Path):
    port = free_port()
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
    sched += ["--log-level", "info", "--worker-recovery-timeout", str(TIMEOUT_S)]
    reqs = [
        pb.GenerateRequest(
            request_id=f"f{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 1, 8, 9]),
            sampling_params=greedy(5000, ignore_eos=True),
            stream=True,
        )
        for i in range(4)
    ]
    workers = _start_workers(tmp_path, port, KILLS + 1)
    timeline: dict = {}
    try:
        with process(tmp_path, "scheduler", sched) as sport:
            address = f"127.0.0.1:{sport}"
            done: list[float] = []

            async def flap(progress: list[int]) -> None:
                used: set[int] = set()
                current = await _next_session(workers, used)
                await wait_for_progress(progress, len(reqs))
                for n in range(1, KILLS + 1):  # each death followed by a reconnect
                    workers[current][0].send_signal(signal.SIGKILL)
                    current = await _next_session(workers, used)
                    await asyncio.sleep(1.0)  # up long enough to run some steps
                    if len(done) == len(reqs):
                        timeline["ended_while_flapping"] = n
                        break
                for proc, _ in workers:
                    proc.send_signal(signal.SIGKILL)

            async def run() -> list:
                progress = [0] * len(reqs)

                async def one(s: pb_grpc.SglangSchedulerStub, i: int) -> tuple[list, object]:
                    tokens: list[int] = []
                    try:
                        async for r in s.Generate(reqs[i], timeout=120):
                            tokens.extend(r.chunk.token_ids)
                            progress[i] = len(tokens)
                        return tokens, None
                    except grpc.aio.AioRpcError as e:
                        return tokens, e
                    finally:
                        done.append(time.monotonic())

                async with grpc.aio.insecure_channel(address) as ch:
                    s = pb_grpc.SglangSchedulerStub(ch)
                    tasks = [asyncio.create_task(one(s, i)) for i in range(len(reqs))]
                    await flap(progress)
                    return await asyncio.gather(*tasks)

            results = asyncio.run(run())
            log = (tmp_path / "scheduler.log").read_text()
    finally:
        for proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # they ended while the worker was still flapping, not one timeout after it stopped
    assert "ended_while_flapping" in timeline, "the requests outlived the flapping"
    for tokens, err in results:
        assert isinstance(err, grpc.aio.AioRpcError), (len(tokens), err)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert f"worker group lost and not back within {TIMEOUT_S} s" in err.details()
        assert "never stayed up" in err.details()
        assert 0 < len(tokens) < 5000
    assert log.count("worker group back") >= 2
    print(f"the streams ended by the {timeline['ended_while_flapping']}th loss")
