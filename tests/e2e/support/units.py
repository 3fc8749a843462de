"""A unit (one radixserve-worker and the radixserve-scheduler bound to it) on
fixed loopback ports, so that it can be stopped with SIGTERM, as a pod
deletion does, and started again where it was."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.support.system import BIN, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(address: str, service: str = "") -> int:
    """grpc.health.v1 Check of ``service`` (what a kubelet gRPC probe asks)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def wait_for_file(proc: subprocess.Popen, path: Path, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text()):
        assert proc.poll() is None, f"{proc.args[0]} exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{proc.args[0]} did not start:\n{log.read_text()}"
        time.sleep(0.1)


class Unit:
    def __init__(
        self,
        tmp: Path,
        name: str,
        worker_args: list[str],
        scheduler_args: list[str],
    ) -> None:
        self.tmp, self.name = tmp, name
        self.worker_args, self.scheduler_args = worker_args, scheduler_args
        self.worker_port, self.port, self.health_port = free_port(), free_port(), free_port()
        self.worker: subprocess.Popen | None = None
        self.scheduler: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.tmp / f"{self.name}-scheduler.log"

    def start(self) -> None:
        self.starts += 1
        self.start_worker()
        sfile = self.tmp / f"{self.name}-scheduler-{self.starts}.port"
        self.scheduler = _spawn(
            [str(BIN / "radixserve-scheduler"), *self.scheduler_args]
            + ["--worker", f"grpc://127.0.0.1:{self.worker_port}"]
            + ["--port", str(self.port), "--port-file", str(sfile)]
            + ["--health-port", str(self.health_port)],
            self.log,
        )
        wait_for_file(self.scheduler, sfile, self.log)

    def start_worker(self) -> None:
        """The worker alone (again, on its port: the scheduler reconnects)."""
        wlog = self.tmp / f"{self.name}-worker.log"
        wfile = self.tmp / f"{self.name}-worker-{self.starts}-{time.monotonic_ns()}.port"
        self.worker = _spawn(
            [str(BIN / "radixserve-worker"), *self.worker_args]
            + ["--port", str(self.worker_port), "--port-file", str(wfile)],
            wlog,
        )
        wait_for_file(self.worker, wfile, wlog)

    def sigterm(self) -> None:
        """SIGTERM to both processes at once (a rolling restart of the unit)."""
        for proc in (self.scheduler, self.worker):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 60) -> tuple[float, int, int]:
        """Wait for both to exit: (seconds, scheduler status, worker status)."""
        t0 = time.monotonic()
        codes = [p.wait(timeout_s) for p in (self.scheduler, self.worker)]
        return time.monotonic() - t0, codes[0], codes[1]

    def kill(self) -> None:
        for proc in (self.scheduler, self.worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
