"""The soak program's server handling and memory accounting (benchmarks/soak.py)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent
UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """'90' or '90s', '10m', '1h' -> seconds."""
    text = text.strip().lower()
    if text and text[-1] in UNITS:
        return float(text[:-1]) * UNITS[text[-1]]
    return float(text)


def print_row(cells: list, header: bool = False) -> None:
    print(" ".join(f"{c!s:>9}" for c in cells), flush=True)
    if header:
        print(" ".join("-" * 9 for _ in cells), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc (the whole machine: a process tree walk needs it)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # the command name may hold spaces or ')': the fields after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def _vmrss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _label(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    if "resource_tracker" in cmd:
        return None  # multiprocessing's bookkeeping process: a few MB, not ours
    if "worker_service" in cmd:
        return f"worker{pid}"
    if "multiprocessing" in cmd:  # spawn_main: the scheduler's core process
        return "core"
    return f"pid{pid}"


def rss_by_process(root: int) -> dict[str, int]:
    """VmRSS of ``root`` (the API process of `radixserve serve`) and its
    descendants, by role; the workers are numbered in pid order."""
    tree, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        name = "api" if pid == root else _label(pid)
        rss = _vmrss(pid)
        if name is not None and rss is not None:
            out[name] = rss
    workers = sorted(k for k in out if k.startswith("worker"))
    return {(f"worker{workers.index(k)}" if k in workers else k): v for k, v in out.items()}


def rss_from_metrics(ports: list[int], host: str) -> dict[str, int]:
    """process_resident_memory_bytes of each /metrics (one process each)."""
    out = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                out[f"m{port}"] = int(float(line.split()[1]))
    return out


class Server:
    """The server under test: started here (``pid`` known) or given by --server."""

    def __init__(self, address: str, pid: int | None, metrics_ports: list[int]) -> None:
        self.address, self.pid, self.metrics_ports = address, pid, metrics_ports

    def rss(self) -> dict[str, int]:
        if self.pid is not None:
            return rss_by_process(self.pid)
        return rss_from_metrics(self.metrics_ports, self.address.rsplit(":", 1)[0])

    @classmethod
    @contextmanager
    def open(cls, args: argparse.Namespace) -> Iterator[Server]:
        if args.server:
            yield cls(args.server, None, args.metrics_ports)
            return
        with tempfile.TemporaryDirectory(prefix="soak-") as d:
            port_file, log_path = Path(d) / "serve.port", Path(d) / "serve.log"
            env = {
                **os.environ,
                # `radixserve serve` has no flags for these; its worker reads them
                "RADIXSERVE_WORKER_SIMULATED_STEP_MS": str(args.step_ms),
                "RADIXSERVE_WORKER_NUM_PAGES": str(args.num_pages),
            }
            cmd = [str(BIN / "radixserve"), "serve", "--model", "simulated", "--port", "0"]
            cmd += ["--port-file", str(port_file), "--metrics-port", str(_free_port())]
            cmd += ["--log-level", "warning"]
            with open(log_path, "w") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                deadline = time.monotonic() + 120
                while not (port_file.exists() and port_file.read_text()):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"radixserve serve failed:\n{log_path.read_text()}")
                    time.sleep(0.2)
                yield cls(f"127.0.0.1:{port_file.read_text()}", proc.pid, [])
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def growth_report(
    samples: list[tuple[float, dict[str, int]]], warm_t: float, max_growth: float
) -> tuple[bool, list[str]]:
    """Peak RSS of each process over the first third of the samples past
    ``warm_t`` against the peak over the last third; the start is warm-up
    (pools, caches and the radix tree fill). Peaks, not single samples: a
    process whose garbage collector runs every few tens of seconds saws up
    and down by megabytes, and two samples would compare its phases."""
    if len(samples) < 2:
        return False, ["memory: fewer than 2 samples, no growth figure"]
    post = [s for s in samples if s[0] >= warm_t]
    if len(post) < 2:
        post = samples[-2:]
    k = max(1, len(post) // 3)
    first, last = post[:k], post[-k:]
    names = sorted({n for _, rss in post for n in rss})
    ok, lines = (
        True,
        [
            f"memory growth, peak over {first[0][0]:.0f}-{first[-1][0]:.0f} s -> peak over "
            f"{last[0][0]:.0f}-{last[-1][0]:.0f} s (limit {max_growth:.0%}):"
        ],
    )
    for name in names:
        a = max(rss.get(name, 0) for _, rss in first)
        b = max(rss.get(name, 0) for _, rss in last)
        growth = b / a - 1 if a else float("inf")
        ok = ok and growth <= max_growth
        lines.append(f"  {name:>8}: {a / 2**20:7.1f} MiB -> {b / 2**20:7.1f} MiB ({growth:+.1%})")
    return ok, lines
