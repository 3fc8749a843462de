"""The hardening round's deployment: an OTLP receiver, `radixserve serve`
(default model, metrics, tracing) and the SMG gateway in front of it, all
on loopback; the processes as /proc shows them; and the leak checks run
after every phase."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from observability.otlp_receiver import OtlpReceiver, ReceivedSpan

BIN = Path(sys.executable).parent
TAG_VAR = "RADIXSERVE_HARDENING_TAG"  # every process of ours inherits it

# cmdline markers -> role (the first that matches)
ROLES = (
    ("resource_tracker", "resource-tracker"),
    ("worker_service.telemetry.span_process", "span"),
    ("worker_service.sampling.grammar_zygote", "zygote"),
    ("multiprocessing", "core"),
    ("-m worker_service", "worker"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    start: int  # clock ticks after boot: tells a reused pid apart
    cmdline: str
    rss: int  # bytes


def read_proc(pid: int) -> Proc | None:
    base = Path("/proc") / str(pid)
    try:
        stat = (base / "stat").read_text()
        cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return Proc(
        pid, int(fields[1]), fields[0], int(fields[19]), cmd.strip(), int(fields[21]) * 4096
    )


def all_procs() -> list[Proc]:
    found = (read_proc(int(p)) for p in os.listdir("/proc") if p.isdigit())
    return [p for p in found if p is not None]


def tagged(tag: str) -> list[Proc]:
    """Every living process whose environment carries ``tag`` (ours, however
    it was started or reparented)."""
    out = []
    needle = f"{TAG_VAR}={tag}".encode()
    for p in all_procs():
        try:
            env = (Path("/proc") / str(p.pid) / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and p.state != "Z":
            out.append(p)
    return out


def role_of(p: Proc, by_pid: dict[int, Proc], root: int) -> str:
    if p.pid == root:
        return "api"
    for marker, role in ROLES:
        if marker in p.cmdline:
            parent = by_pid.get(p.ppid)
            if role == "zygote" and parent is not None and marker in parent.cmdline:
                return "compile-child"  # forked by the zygote: its cmdline
            return role
    return "other"


@dataclass
class Tree:
    """`radixserve serve` and its descendants at one moment, by role."""

    root: int
    procs: list[Proc] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)

    @classmethod
    def read(cls, root: int) -> Tree:
        everything = all_procs()
        by_pid = {p.pid: p for p in everything}
        children: dict[int, list[Proc]] = {}
        for p in everything:
            children.setdefault(p.ppid, []).append(p)
        tree = cls(root)
        todo = [by_pid[root]] if root in by_pid else []
        while todo:
            p = todo.pop()
            tree.procs.append(p)
            tree.roles[p.pid] = role_of(p, by_pid, root)
            todo.extend(children.get(p.pid, []))
        return tree

    def pids(self, role: str) -> list[int]:
        return [p.pid for p in self.procs if self.roles[p.pid] == role and p.state != "Z"]

    def count(self) -> Counter[str]:
        return Counter(self.roles[p.pid] for p in self.procs if p.state != "Z")

    def zombies(self) -> list[Proc]:
        return [p for p in self.procs if p.state == "Z"]


class SpanWatch:
    """What the OTLP receiver got, by service: counts and the latest end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: Counter[str] = Counter()
        self.last_end_ns: dict[str, int] = {}

    def __call__(self, spans: list[ReceivedSpan]) -> None:
        with self.lock:
            for s in spans:
                key = f"{s.service}/{s.name}"
                self.count[key] += 1
                self.last_end_ns[key] = max(self.last_end_ns.get(key, 0), s.end_ns)

    def since(self, key: str, t_ns: int) -> bool:
        with self.lock:
            return self.last_end_ns.get(key, 0) > t_ns


class Deployment:
    """The processes under test. ``workdir`` keeps their logs."""

    def __init__(self, workdir: Path, model: str, extra_serve_args: list[str]) -> None:
        self.workdir = workdir
        self.model = model
        self.extra = extra_serve_args
        self.tag = f"{os.getpid()}-{time.time_ns()}"
        self.metrics_port = free_port()
        self.spans = SpanWatch()
        self.receiver = OtlpReceiver(keep=False)
        self.receiver.on_spans = self.spans
        self.serve: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.address = ""
        self.gateway_base = ""
        self.model_name = ""
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.SglangSchedulerStub | None = None

    # ------------------------------------------------------------ start, stop
    def start(self) -> float:
        """Start everything; seconds until the gateway was ready."""
        t0 = time.monotonic()
        self.receiver.start()
        env = {
            **os.environ,
            TAG_VAR: self.tag,
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash in native code leaves its Python stacks
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": self.receiver.protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "1000",
        }
        for key in ("OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):
            env.pop(key, None)
        port_file = self.workdir / "serve.port"
        cmd = [str(BIN / "radixserve"), "serve", "--model", self.model, "--port", "0"]
        cmd += ["--port-file", str(port_file), "--metrics-port", str(self.metrics_port)]
        cmd += ["--log-format", "json", *self.extra]
        with open(self.workdir / "serve.log", "w") as log:
            self.serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while not (port_file.exists() and port_file.read_text()):
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"radixserve serve did not start; see {self.workdir}/serve.log")
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.model_name = self.stub.GetModelInfo(pb.GetModelInfoRequest()).served_model_name
        self._start_gateway()
        return time.monotonic() - t0

    def _start_gateway(self) -> None:
        port = free_port()
        cmd = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", f"grpc://{self.address}"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--shutdown-grace-period-secs", "0", "--worker-startup-check-interval", "1"]
        with open(self.workdir / "smg.log", "w") as log:
            self.gateway = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.gateway_base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.gateway_base + "/readiness", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not become ready; see {self.workdir}/smg.log")
            time.sleep(0.3)

    def stop(self) -> None:
        for proc in (self.gateway, self.serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.channel is not None:
            self.channel.close()
        self.receiver.stop()

    # ------------------------------------------------------------ processes
    def tree(self) -> Tree:
        assert self.serve is not None
        return Tree.read(self.serve.pid)

    def one(self, role: str, timeout_s: float = 0.0) -> int:
        """The pid of the one process of ``role`` (waiting for it up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.tree().pids(role)
            if len(pids) == 1:
                return pids[0]
            if time.monotonic() >= deadline:
                raise RuntimeError(f"expected one {role} process, found {pids}")
            time.sleep(0.1)

    def worker_port(self) -> int:
        """The worker's gRPC port, from its command line (serve chose it)."""
        cmd = read_proc(self.one("worker", 60)).cmdline.split()
        return int(cmd[cmd.index("--port") + 1])

    @property
    def worker_metrics_port(self) -> int:
        return self.metrics_port + 1  # serve gives rank r metrics_port + 1 + r

    # ------------------------------------------------------------ the API
    def server_info(self) -> dict:
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).scheduler_info
        return dict(info)

    def used_tokens(self) -> int:
        load = self.stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
        return load.num_used_tokens

    def flush(self) -> bool:
        return self.stub.FlushCache(cpb.FlushCacheRequest(timeout_s=30), timeout=40).success

    def readiness(self) -> str:
        try:
            health = health_pb2_grpc.HealthStub(self.channel)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as e:
            return e.code().name

    def metrics_answer(self) -> list[str]:
        """Problems with the scheduler's and the worker's /metrics."""
        problems = []
        for name, port in (("scheduler", self.metrics_port), ("worker", self.worker_metrics_port)):
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=10) as r:
                    if b"radixserve_" not in r.read():
                        problems.append(f"{name} /metrics has no radixserve_ series")
            except (urllib.error.URLError, OSError) as e:
                problems.append(f"{name} /metrics did not answer: {e}")
        return problems
