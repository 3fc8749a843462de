"""``radixserve``: the all-in-one launcher.

``radixserve serve`` starts a worker group (one ``radixserve-worker`` process
per tensor-parallel rank) and the scheduler in front of it, and shuts the
children down cleanly on Ctrl-C / SIGTERM. Every child dies with it however
it dies (common/lifeline.py), and its temporary directory goes on every exit
it controls. ``radixserve export-tokenizer DIR`` writes the model's tokenizer
files (for the SMG gateway's --model-path).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
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

from common.lifeline import child_env
from common.restart_backoff import RestartBackoff
from common.settings import add_flags, build
from observability.logging_setup import configure_logging
from scheduler_service.api.server import STARTUP_ERRORS
from scheduler_service.api.server import serve as serve_scheduler
from scheduler_service.config import (
    ServiceConfig,
    add_service_flags,
    check_security_flags,
    service_config,
)
from worker_service.config import ENV_PREFIX as WORKER_ENV_PREFIX
from worker_service.config import WorkerConfig, check_hicache_flags, rank_device

logger = structlog.get_logger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The worker settings `radixserve serve` takes (declared in WorkerConfig) and
# passes on to each rank; --threads is --worker-threads here.
WORKER_FLAGS = frozenset(
    {
        "model",
        "device",
        "tp_size",
        "page_size",
        "kv_memory",
        "threads",
        "pooling",
        "embed_normalize",
        "dequantize",
        "enable_hierarchical_cache",
        "hicache_ratio",
        "hicache_size",
        "hicache_file_dir",
        "hicache_file_size",
    }
)
WORKER_FLAG_NAMES = {"threads": "--worker-threads"}


def _worker_args(
    worker: WorkerConfig,
    service: ServiceConfig,
    rank: int,
    port_file: Path,
    *,
    dist: str,
    port: int,
) -> list[str]:
    cmd = [sys.executable, "-m", "worker_service", "--model", worker.model]
    device = rank_device(worker.device, rank, worker.tp_size)
    cmd += ["--device", device, "--page-size", str(worker.page_size)]
    cmd += ["--kv-memory", worker.kv_memory, "--port", str(port), "--port-file", str(port_file)]
    cmd += ["--tp-size", str(worker.tp_size), "--tp-rank", str(rank)]
    cmd += ["--pooling", worker.pooling, "--embed-normalize", worker.embed_normalize]
    cmd += ["--log-level", service.log_level, "--log-format", service.log_format]
    if worker.dequantize:
        cmd += ["--dequantize"]
    if worker.enable_hierarchical_cache:
        cmd += ["--enable-hierarchical-cache", "--hicache-ratio", str(worker.hicache_ratio)]
        cmd += ["--hicache-size", str(worker.hicache_size)]
        if worker.hicache_file_dir:  # each rank its own folder under it (the layout's)
            cmd += ["--hicache-file-dir", worker.hicache_file_dir]
            cmd += ["--hicache-file-size", str(worker.hicache_file_size)]
    if service.api.metrics_port is not None:
        cmd += ["--metrics-port", str(service.api.metrics_port + 1 + rank)]
    if worker.tp_size > 1:
        cmd += ["--dist-addr", dist]
    security = service.security
    if security.worker_tls_ca:
        # The workers serve the same certificate the scheduler presents to them
        # (it needs both the serverAuth and clientAuth usages, or neither).
        cmd += ["--worker-tls-ca", security.worker_tls_ca]
        cmd += ["--worker-tls-cert", security.worker_tls_cert or ""]
        cmd += ["--worker-tls-key", security.worker_tls_key or ""]
    if security.worker_token_file:
        cmd += ["--worker-token-file", security.worker_token_file]
    if worker.device == "cpu":
        # Every core: the scheduler and API processes sleep between events
        # (overlap plans the next step while the worker computes), and on 2
        # cores two torch threads served the shared-prefix load 1.30x and the
        # random load 1.46x faster than one (docs/benchmarks.md, issue 18).
        threads = worker.threads or max(1, os.cpu_count() or 1)
        cmd += ["--threads", str(threads)]
    return cmd


class WorkerProcesses:
    """The worker group's processes, restarted when one dies.

    Each rank keeps the port chosen for it at start, so the scheduler finds
    the restarted group where it lost it (it reconnects by itself). With
    tensor parallelism the whole group restarts: its ranks are joined by
    torch.distributed, which cannot take one member back (backoff:
    common/restart_backoff.py).

    Every worker dies with this process (``child_env``: the worker arms
    PR_SET_PDEATHSIG and a parent watch). The kernel's signal follows the
    *thread* that started the child, so the watcher thread, which starts
    the restarted groups, lives until stop() has stopped them.
    """

    def __init__(self, worker: WorkerConfig, service: ServiceConfig, workdir: Path) -> None:
        self.worker = worker
        self.service = service
        self.procs: list[subprocess.Popen] = []
        self.port_files = [workdir / f"worker{r}.port" for r in range(worker.tp_size)]
        self.ports = [_free_port() for _ in range(worker.tp_size)]
        self.restarts = 0
        self.backoff = RestartBackoff()
        self._lock = threading.Lock()  # no restart may race stop()
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # stop() has stopped the processes
        self._watcher: threading.Thread | None = None
        self._start_group()

    def _start_group(self) -> None:
        dist = f"127.0.0.1:{_free_port()}"
        self.procs = []
        for rank, (pf, port) in enumerate(zip(self.port_files, self.ports, strict=True)):
            pf.unlink(missing_ok=True)
            cmd = _worker_args(self.worker, self.service, rank, pf, dist=dist, port=port)
            self.procs.append(subprocess.Popen(cmd, env=child_env()))
        self._started_at = time.monotonic()

    def watch(self) -> None:
        """Restart the group whenever a rank dies, from now until stop()."""
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="worker-watch")
        self._watcher.start()

    def _watch(self) -> None:
        try:
            self._restart_dead()
        finally:
            # The workers this thread started get SIGKILL when it ends: let
            # stop() end them first (a SIGTERM, their drain).
            self._stopped.wait()

    def _restart_dead(self) -> None:
        while not self._stopping.wait(0.5):
            dead = {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}
            if not dead:
                continue
            # A worker stops with status 0 only when told to (Ctrl-C reaches
            # the whole process group before stop() runs): that is shutdown.
            if all(code == 0 for code in dead.values()):
                logger.warning("worker process stopped; not restarting it", ranks=sorted(dead))
                return
            delay = self.backoff.delay(time.monotonic() - self._started_at)
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
        self._stopped.set()

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


class Stopped(BaseException):
    """SIGTERM outside the scheduler's own handling (while the workers start,
    or while they stop): unwind, so the ``finally:`` clauses run."""


def _stop_by_exception(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _serve(args: argparse.Namespace) -> int:
    service = service_config(args, ())
    configure_logging(service.log_level, service.log_format)
    # Until the scheduler serves (its drain takes SIGTERM over) and again
    # after it: the default action would end this process without cleaning up.
    signal.signal(signal.SIGTERM, _stop_by_exception)
    # The workers' port files; the scheduler keeps its own directory.
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-serve-"))
    try:
        worker = build(WorkerConfig, args)
        check_hicache_flags(worker)  # before any worker starts
        workers = WorkerProcesses(worker, service, workdir)
        try:
            addresses = workers.addresses()
            workers.watch()
            config = dataclasses.replace(service, workers=tuple(addresses))
            try:
                asyncio.run(serve_scheduler(config))
            finally:
                signal.signal(signal.SIGTERM, _stop_by_exception)  # asyncio reset it
        finally:
            workers.stop()
    except STARTUP_ERRORS as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (Stopped, KeyboardInterrupt) as e:
        logger.warning("stopped by a signal while starting or stopping", signal=str(e) or "SIGINT")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _export_tokenizer(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "worker_service.export_tokenizer", "--model", args.model, args.dir]
    return subprocess.call(cmd)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixserve", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model: a worker group and the scheduler")
    add_flags(
        s, WorkerConfig, os.environ, WORKER_ENV_PREFIX, only=WORKER_FLAGS, rename=WORKER_FLAG_NAMES
    )
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
