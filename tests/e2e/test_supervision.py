"""No process outlives its parent however the parent dies, and `radixserve
serve` leaves no temporary directory behind on any exit it controls.

The process tree is read from /proc before the kill: `serve`'s workers, the
core it spawns (and multiprocessing's resource tracker), and with tracing on
each worker's span process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from observability.otlp_receiver import OtlpReceiver
from tests.e2e.support.system import BIN, free_port, greedy, separate, serve_process, stub
from tests.e2e.support.tracing import tracing_env
from tests.support.process_tree import Proc, descendants, still_running

SIM = ("--model", "simulated", "--log-level", "info")
WORKER = "-m worker_service "
SPAN_PROCESS = "worker_service.telemetry.span_process"
CORE = "multiprocessing.spawn"


def _kinds(tree: list[Proc]) -> set[str]:
    return {k for p in tree for k in (WORKER, SPAN_PROCESS, CORE) if k in p.cmdline}


def _generate(address: str) -> None:
    request = pb.GenerateRequest(
        request_id="one",
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=greedy(4),
    )
    (out,) = list(stub(address).Generate(request, timeout=60))
    assert out.complete.output_ids


def _sigkill_leaves_nothing(proc: subprocess.Popen) -> tuple[list[Proc], float]:
    """SIGKILL ``proc``; (its descendants still running 2 s later, seconds
    until the last one went)."""
    tree = descendants(proc.pid)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    left = still_running(tree, 2.0)
    return left, time.monotonic() - t0


@pytest.mark.parametrize("model", ["simulated", pytest.param("default", marks=pytest.mark.slow)])
def test_sigkill_of_serve_leaves_no_process_within_2s(tmp_path, model):
    """Workers, their span processes (tracing on) and the core all go."""
    receiver = OtlpReceiver().start()
    try:
        args = ("--model", model, "--log-level", "info")
        with serve_process(tmp_path, *args, env=tracing_env(receiver)) as (proc, address):
            _generate(address)
            tree = descendants(proc.pid)
            assert _kinds(tree) == {WORKER, SPAN_PROCESS, CORE}, [p.cmdline for p in tree]
            left, seconds = _sigkill_leaves_nothing(proc)
    finally:
        receiver.stop()
    print(f"{model}: {len(tree)} processes below serve, the last gone {seconds:.2f} s after")
    assert not left, [p.cmdline for p in left]


def test_sigkill_of_the_scheduler_leaves_no_core(tmp_path):
    """Serving (the core would see its pipe close at its next read) and
    starting (the core waits for a worker that is not up yet, reading no
    pipe: it used to wait on alone for the 10 minutes of its connect)."""
    with separate(tmp_path, [*SIM], ["--log-level", "info"]) as address:
        _generate(address)
        (sched,) = [p for p in descendants(os.getpid()) if "radixserve-scheduler" in p.cmdline]
        (worker,) = [p for p in descendants(os.getpid()) if "radixserve-worker" in p.cmdline]
        tree = descendants(sched.pid)
        assert CORE in _kinds(tree)
        os.kill(sched.pid, signal.SIGKILL)
        left = still_running(tree, 2.0)
        assert not left, [p.cmdline for p in left]
        assert still_running([worker], 0.0)  # not its child: it serves on

    nobody = f"grpc://127.0.0.1:{free_port()}"
    args = [str(BIN / "radixserve-scheduler"), "--worker", nobody, "--port", "0"]
    with open(tmp_path / "starting.log", "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while CORE not in _kinds(descendants(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(1.0)  # into its connect
        left, _ = _sigkill_leaves_nothing(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not left, [p.cmdline for p in left]


def _empty_tmpdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    return tmpdir, {"TMPDIR": str(tmpdir)}


def test_the_temporary_directories_go_on_sigterm(tmp_path):
    tmpdir, env = _empty_tmpdir(tmp_path)
    with serve_process(tmp_path, *SIM, env=env) as (proc, address):
        _generate(address)
        assert sorted(p.name.rsplit("-", 1)[0] for p in tmpdir.iterdir()) == [
            "radixserve",  # the scheduler's (tokenizer files)
            "radixserve-serve",  # serve's (the workers' port files)
        ]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert list(tmpdir.iterdir()) == []


def test_the_temporary_directory_goes_after_a_startup_error(tmp_path):
    tmpdir, env = _empty_tmpdir(tmp_path)
    out = subprocess.run(
        [str(BIN / "radixserve"), "serve", "--model", str(tmp_path / "no-such-model")]
        + ["--port", "0"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "a worker exited with status" in out.stderr, out.stderr[-2000:]
    assert list(tmpdir.iterdir()) == []


def test_sigterm_while_the_workers_start_stops_them_and_cleans_up(tmp_path):
    """The default model takes seconds to load: SIGTERM meanwhile (before the
    scheduler's own drain handles it) stops the worker and exits cleanly."""
    tmpdir, env = _empty_tmpdir(tmp_path)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "radixserve"), "serve", "--model", "default", "--port", "0"],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not any(WORKER in p.cmdline for p in descendants(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # the worker is importing torch or loading the model
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-3000:]
    assert "stopped by a signal while starting or stopping" in log.read_text()
    assert not still_running(tree, 0.0)
    assert list(tmpdir.iterdir()) == []
