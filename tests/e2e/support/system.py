"""Real radixserve processes on loopback ports, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(proc: subprocess.Popen, port_file: Path, log: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not (port_file.exists() and port_file.read_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.args[0]} did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return int(port_file.read_text())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def started(
    tmp: Path, name: str, args: list[str], timeout_s: float = 300, env: dict | None = None
) -> Iterator[tuple[subprocess.Popen, int]]:
    """Start a radixserve command with --port 0; yield the process and the
    port it serves on. ``env`` adds to (or, with None values, removes from)
    the environment."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*args, "--port", "0", "--port-file", str(port_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        try:
            yield proc, _wait_port(proc, port_file, log, timeout_s)
        finally:
            _stop(proc)


@contextmanager
def process(
    tmp: Path, name: str, args: list[str], timeout_s: float = 300, env: dict | None = None
) -> Iterator[int]:
    """Start a radixserve command with --port 0; yield the port it serves on."""
    with started(tmp, name, args, timeout_s, env) as (_, port):
        yield port


@contextmanager
def serve(tmp: Path, *args: str) -> Iterator[str]:
    """`radixserve serve ...` (scheduler + worker group); yields HOST:PORT."""
    with process(tmp, "serve", [str(BIN / "radixserve"), "serve", *args]) as port:
        yield f"127.0.0.1:{port}"


@contextmanager
def serve_process(
    tmp: Path, *args: str, env: dict | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`radixserve serve ...`; yields its process (to signal) and HOST:PORT.
    Its output goes to ``tmp / "serve.log"``."""
    with started(tmp, "serve", [str(BIN / "radixserve"), "serve", *args], env=env) as (p, port):
        yield p, f"127.0.0.1:{port}"


@contextmanager
def separate(
    tmp: Path, worker_args: list[str], scheduler_args: list[str], env: dict | None = None
) -> Iterator[str]:
    """radixserve-worker and radixserve-scheduler started apart; yields HOST:PORT."""
    worker = [str(BIN / "radixserve-worker"), *worker_args]
    with process(tmp, "worker", worker, env=env) as wport:
        sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
        with process(tmp, "scheduler", sched + scheduler_args, env=env) as port:
            yield f"127.0.0.1:{port}"


@contextmanager
def worker_on_port(tmp: Path, port: int, args: list[str], name: str) -> Iterator[subprocess.Popen]:
    """radixserve-worker on a fixed port (a restart must come back where it was)."""
    port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "radixserve-worker"), *args, "--port", str(port)]
            + ["--port-file", str(port_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline = time.monotonic() + 300
            while not (port_file.exists() and port_file.read_text()):
                assert proc.poll() is None, f"worker exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"worker did not start:\n{log.read_text()}"
                time.sleep(0.2)
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def stub(address: str) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))


def greedy(max_new: int, **extra) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, **extra)


def used_tokens(s: pb_grpc.SglangSchedulerStub) -> int:
    return s.GetLoads(pb.GetLoadsRequest(include=["core"])).loads[0].num_used_tokens


def wait_until(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def scrape_metric(port: int, name: str) -> float:
    """The value of an unlabelled metric on a /metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")
