"""A hung worker (SIGSTOP: it keeps its connection but answers nothing) is
noticed, by the step deadline or by keepalive, and the usual worker-loss
recovery runs: once the process continues (SIGCONT), the scheduler opens a
new session, the old one is fenced off, and every stream ends with the tokens
of an undisturbed run. Before, the scheduler waited for the step forever."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import BIN, free_port, greedy, process, worker_on_port

pytestmark = pytest.mark.slow

WORKER = ["--model", "simulated", "--simulated-step-ms", "15", "--log-level", "info"]


def _streams(prefix: str) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(
            request_id=f"{prefix}{i}",
            tokenized=pb.TokenizedInput(input_ids=[i + 11, 4, 4, 2]),
            sampling_params=greedy(150, ignore_eos=True),
            stream=True,
        )
        for i in range(6)
    ]


async def _wait_for_log(path: Path, text: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while text not in path.read_text():
        assert time.monotonic() - t0 < timeout_s, f"no {text!r} in {path.name} in {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.parametrize(
    ("detector", "flags", "says"),
    [
        (
            "step deadline",
            ["--worker-step-timeout", "1", "--worker-keepalive", "60"],
            "waiting for a step result",
        ),
        ("keepalive", ["--worker-keepalive", "1"], "worker group lost"),
    ],
)
def test_a_stopped_worker_is_noticed_and_recovered_with_identical_outputs(
    tmp_path: Path, detector: str, flags: list[str], says: str
):
    wport = free_port()
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
    sched += ["--log-level", "info", "--worker-recovery-timeout", "60", *flags]
    holder: dict = {}
    with (
        worker_on_port(tmp_path, wport, WORKER, "worker") as proc,
        process(tmp_path, "scheduler", sched) as sport,
    ):
        address = f"127.0.0.1:{sport}"
        log = tmp_path / "scheduler.log"
        baseline = asyncio.run(run_streams(address, _streams("base-")))
        assert all(reason == "length" for _, reason in baseline)

        async def stop_and_continue(progress: list[int]) -> None:
            await wait_for_progress(progress, len(progress), tokens=10)
            proc.send_signal(signal.SIGSTOP)
            try:
                holder["noticed_s"] = await _wait_for_log(log, "worker group lost", 15)
                await asyncio.sleep(1.0)  # reconnect attempts meet the stopped worker
            finally:
                proc.send_signal(signal.SIGCONT)

        disturbed = asyncio.run(run_streams(address, _streams("hung-"), stop_and_continue))
        for (tokens, reason), (base, _) in zip(disturbed, baseline, strict=True):
            assert reason == "length", reason
            assert tokens == base
        # the service goes on serving on the new session
        again = asyncio.run(run_streams(address, _streams("after-")))
        assert [t for t, _ in again] == [t for t, _ in baseline]
    text = log.read_text()
    assert says in text and "worker group back" in text
    assert text.count("worker group lost") == 1
    worker_log = (tmp_path / "worker.log").read_text()
    assert worker_log.count("scheduler session opened") == 2
    print(f"{detector}: the stopped worker was noticed after {holder['noticed_s']:.1f} s")
