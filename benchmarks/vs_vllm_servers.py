"""vs_vllm.py's servers: `radixserve serve` with the smg gateway in front,
vLLM's OpenAI server or llama.cpp's (the peer scripts), each in its own process group,
ready when it answers and stopped as a whole."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
VLLM_SCRIPT = ROOT.parent / "shared" / "peers" / "vllm_cpu.sh"
LLAMA_CPP_SCRIPT = ROOT.parent / "shared" / "peers" / "llama_cpp.sh"


def served_name(model: str) -> str:
    """The model name both servers answer to: the directory's or file's name."""
    return Path(model).name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_models(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until GET /v1/models lists a model (the process must stay alive)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if json.loads(r.read()).get("data"):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{log} did not get ready:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def probe_completion(base: str, model: str, timeout_s: float) -> None:
    """One small completion (the gateway fetches the unit's tokenizer after it
    lists the model: until then completions fail)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                return
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@dataclass
class Server:
    name: str
    base_url: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    grpc_address: str | None = None
    metrics_urls: tuple[str, ...] = ()  # the scheduler's, then the worker's
    pgids: tuple[int, ...] = ()  # its process groups (started here: its own)

    def groups(self) -> list[int]:
        return list(self.pgids) or [p.pid for p in self.procs]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _popen(cmd: Sequence[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 (the child holds it)
    # Its own process group: stopped as a whole, children included.
    return subprocess.Popen(
        list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextmanager
def radixserve(model: str, extra: Sequence[str], tmp: Path) -> Iterator[Server]:
    """`radixserve serve` and `smg` in front of it; both stopped on exit."""
    port_file = tmp / "radixserve.port"
    port_file.unlink(missing_ok=True)  # an earlier run's
    cmd = [str(BIN / "radixserve"), "serve", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--port-file", str(port_file)]
    cmd += ["--served-model-name", Path(model).name, "--log-level", "warning", *extra]
    metrics = free_port()  # the worker serves its metrics on the next port
    cmd += ["--metrics-port", str(metrics)]
    procs = [_popen(cmd, tmp / "radixserve.log")]
    try:
        deadline = time.monotonic() + 600
        while not (port_file.exists() and port_file.read_text().strip()):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise SystemExit((tmp / "radixserve.log").read_text()[-3000:])
            time.sleep(0.5)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        port = free_port()
        gw = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        gw += ["--worker-urls", f"grpc://{address}"]
        gw += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        gw += ["--worker-startup-check-interval", "1", "--log-level", "warn"]
        gw += ["--shutdown-grace-period-secs", "0"]
        procs.append(_popen(gw, tmp / "smg.log"))
        base = f"http://127.0.0.1:{port}"
        wait_models(base, procs[1], tmp / "smg.log", 120)
        probe_completion(base, Path(model).name, 120)
        urls = (f"http://127.0.0.1:{metrics}/metrics", f"http://127.0.0.1:{metrics + 1}/metrics")
        yield Server("radixserve", base, procs, address, urls)
    finally:
        stop(procs)


@contextmanager
def _peer(
    name: str,
    script: Path,
    model: str,
    extra: Sequence[str],
    tmp: Path,
    *,
    ready_s: float,
    probe: bool,
) -> Iterator[Server]:
    """A peer's OpenAI server through its script (``serve MODEL PORT ...``),
    ready once it lists a model (and, with ``probe``, answers a completion
    for the file's name); stopped on exit."""
    port = free_port()
    log = tmp / f"{name.replace('.', '_')}.log"
    procs = [_popen(["bash", str(script), "serve", model, str(port), *extra], log)]
    try:
        base = f"http://127.0.0.1:{port}"
        wait_models(base, procs[0], log, ready_s)
        if probe:
            probe_completion(base, Path(model).name, 120)
        yield Server(name, base, procs)
    finally:
        stop(procs)


def vllm(model: str, extra: Sequence[str], tmp: Path) -> contextlib.AbstractContextManager[Server]:
    """vLLM's OpenAI server (its first start compiles: up to 15 minutes)."""
    return _peer("vllm", VLLM_SCRIPT, model, extra, tmp, ready_s=900, probe=False)


def llama_cpp(
    gguf: str, extra: Sequence[str], tmp: Path
) -> contextlib.AbstractContextManager[Server]:
    """llama.cpp's OpenAI server on ``gguf`` (the peer script: all cores)."""
    return _peer("llama.cpp", LLAMA_CPP_SCRIPT, gguf, extra, tmp, ready_s=300, probe=True)
