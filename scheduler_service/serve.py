"""``radixserve``: the all-in-one launcher.

``radixserve serve`` starts a worker group (one ``radixserve-worker`` process
per tensor-parallel rank) and the scheduler in front of it, and shuts the
children down cleanly on Ctrl-C / SIGTERM. ``radixserve export-tokenizer DIR``
writes the model's tokenizer files (for the SMG gateway's --model-path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from observability.logging_setup import configure_logging
from scheduler_service.api.server import STARTUP_ERRORS
from scheduler_service.api.server import serve as serve_scheduler
from scheduler_service.config import add_service_flags, check_security_flags, service_config

logger = structlog.get_logger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RESTART_FIRST_S = 1.0  # first restart of a dead worker group after this
RESTART_MAX_S = 30.0  # backoff cap for a group that keeps dying
STABLE_S = 60.0  # a group up this long is healthy again: the backoff starts over


def _worker_args(
    args: argparse.Namespace, rank: int, port_file: Path, dist: str, port: int
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "worker_service",
        "--model",
        args.model,
        "--device",
        args.device,
        "--page-size",
        str(args.page_size),
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--tp-size",
        str(args.tp_size),
        "--tp-rank",
        str(rank),
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
    ]
    if args.metrics_port is not None:
        cmd += ["--metrics-port", str(args.metrics_port + 1 + rank)]
    if args.tp_size > 1:
        cmd += ["--dist-addr", dist]
    if args.worker_tls_ca:
        # The workers serve the same certificate the scheduler presents to them
        # (it needs both the serverAuth and clientAuth usages, or neither).
        cmd += ["--worker-tls-ca", args.worker_tls_ca, "--worker-tls-cert", args.worker_tls_cert]
        cmd += ["--worker-tls-key", args.worker_tls_key]
    if args.kv_memory:
        cmd += ["--kv-memory", args.kv_memory]
    if args.device == "cpu":
        # Leave a core to the scheduler: a busy core makes every small op of a
        # multi-threaded worker wait.
        threads = args.worker_threads or max(1, (os.cpu_count() or 2) - 1)
        cmd += ["--threads", str(threads)]
    return cmd


class WorkerProcesses:
    """The worker group's processes, restarted when one dies.

    Each rank keeps the port chosen for it at start, so the scheduler finds
    the restarted group where it lost it (it reconnects by itself). With
    tensor parallelism the whole group restarts: its ranks are joined by
    torch.distributed, which cannot take one member back.
    """

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.port_files = [workdir / f"worker{r}.port" for r in range(args.tp_size)]
        self.ports = [_free_port() for _ in range(args.tp_size)]
        self.restarts = 0
        self._lock = threading.Lock()  # no restart may race stop()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._start_group()

    def _start_group(self) -> None:
        dist = f"127.0.0.1:{_free_port()}"
        self.procs = []
        for rank, (pf, port) in enumerate(zip(self.port_files, self.ports, strict=True)):
            pf.unlink(missing_ok=True)
            self.procs.append(subprocess.Popen(_worker_args(self.args, rank, pf, dist, port)))
        self._started_at = time.monotonic()

    def watch(self) -> None:
        """Restart the group whenever a rank dies, from now until stop()."""
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="worker-watch")
        self._watcher.start()

    def _watch(self) -> None:
        delay = RESTART_FIRST_S
        while not self._stopping.wait(0.5):
            dead = {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}
            # A worker stops with status 0 only when told to (Ctrl-C reaches
            # the whole process group before stop() runs): that is shutdown.
            if dead and all(code == 0 for code in dead.values()):
                logger.warning("worker process stopped; not restarting it", ranks=sorted(dead))
                return
            if not dead:
                if time.monotonic() - self._started_at > STABLE_S:
                    delay = RESTART_FIRST_S
                continue
            logger.error(
                "worker process died; restarting the worker group",
                exit_codes=dead,
                restart_in_s=delay,
                ports=self.ports,
            )
            with self._lock:
                if self._stopping.is_set():
                    return
                self._terminate()  # the surviving ranks of a tensor-parallel group
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._start_group()
                self.restarts += 1
            delay = min(delay * 2, RESTART_MAX_S)

    def addresses(self, timeout_s: float = 900.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for proc, pf in zip(self.procs, self.port_files, strict=True):
            while not (pf.exists() and pf.read_text()):
                if proc.poll() is not None:
                    raise SystemExit(
                        f"a worker exited with status {proc.returncode} while starting"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit("the workers did not start in time")
                time.sleep(0.2)
        return [f"grpc://127.0.0.1:{pf.read_text()}" for pf in self.port_files]

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self._terminate()

    def _terminate(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-serve-"))
    workers = WorkerProcesses(args, workdir)
    try:
        addresses = workers.addresses()
        workers.watch()
        config = service_config(args, addresses)
        asyncio.run(serve_scheduler(config))
    except STARTUP_ERRORS as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        workers.stop()
    return 0


def _export_tokenizer(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "worker_service.export_tokenizer", "--model", args.model, args.dir]
    return subprocess.call(cmd)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixserve", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model: a worker group and the scheduler")
    s.add_argument(
        "--model",
        default="default",
        help="HF model directory, .gguf file, 'default' (SmolLM2-135M-Instruct) or 'simulated'",
    )
    s.add_argument("--device", default="cpu")
    s.add_argument("--tp-size", type=int, default=1)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--kv-memory", default=None, help="KV cache memory per rank, e.g. 2GiB")
    s.add_argument("--worker-threads", type=int, default=0)
    add_service_flags(s, os.environ)
    e = sub.add_parser("export-tokenizer", help="write the model's tokenizer files to DIR")
    e.add_argument("dir")
    e.add_argument("--model", default="default")
    args = p.parse_args(argv)
    if args.command == "serve":
        check_security_flags(s, args)
        return _serve(args)
    return _export_tokenizer(args)


if __name__ == "__main__":
    sys.exit(main())
