"""What the hardening round checks after every phase, with the background
load paused: the server idle (GetServerInfo's queued_requests and
core_requests 0, nothing running or waiting), the KV pages back once the
cache is flushed, readiness SERVING, both /metrics answering, no stray or
zombie process, and each process's RSS (kept to judge growth at the end)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from hardening_system import Deployment, Tree, tagged
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

# At most this many of each role below serve (a compile child per pool
# ticket at most: --grammar-compile-queue's default).
MOST = {"api": 1, "core": 1, "resource-tracker": 1, "worker": 1, "span": 1, "zygote": 1}
MOST_COMPILE_CHILDREN = 16
IDLE_TIMEOUT_S = 90.0


@dataclass
class Clean:
    problems: list[str] = field(default_factory=list)
    idle_s: float = 0.0
    used_tokens: int = 0
    roles: dict[str, int] = field(default_factory=dict)
    rss: dict[str, int] = field(default_factory=dict)  # "role:pid" -> bytes


def wait_idle(dep: Deployment, timeout_s: float = IDLE_TIMEOUT_S) -> tuple[float, str | None]:
    """(seconds it took, or the problem): queued_requests, core_requests,
    running and waiting all 0."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        try:
            info = dep.server_info()
            load = dep.stub.GetLoads(pb.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
        except grpc.RpcError as e:
            last = f"{e.code().name}: {e.details()}"
            time.sleep(0.5)
            continue
        queued, tracked = int(info.get("queued_requests", -1)), int(info.get("core_requests", -1))
        last = (
            f"queued_requests {queued}, core_requests {tracked}, "
            f"running {load.num_running_reqs}, waiting {load.num_waiting_reqs}"
        )
        if queued == 0 and tracked == 0 and not load.num_running_reqs and not load.num_waiting_reqs:
            return time.monotonic() - t0, None
        time.sleep(0.2)
    return time.monotonic() - t0, f"not idle after {timeout_s:.0f} s: {last}"


def processes(dep: Deployment, tree: Tree) -> list[str]:
    problems = []
    ours = {p.pid for p in tree.procs}
    strays = [p for p in tagged(dep.tag) if p.pid not in ours]
    if strays:
        problems.append(
            "processes outside serve's tree: "
            + "; ".join(f"{p.pid} {p.cmdline[:80]}" for p in strays)
        )
    count = tree.count()
    for role, most in MOST.items():
        if count.get(role, 0) > most:
            problems.append(f"{count[role]} {role} processes (at most {most})")
    if count.get("compile-child", 0) > MOST_COMPILE_CHILDREN:
        problems.append(f"{count['compile-child']} grammar compile children")
    if count.get("other"):
        others = [p.cmdline[:80] for p in tree.procs if tree.roles[p.pid] == "other"]
        problems.append(f"unexpected processes: {others}")
    for role in ("core", "worker"):
        if not count.get(role):
            problems.append(f"no {role} process")
    zombies = tree.zombies()
    if zombies:
        problems.append(f"zombies: {[(z.pid, z.cmdline[:40]) for z in zombies]}")
    return problems


def check_clean(dep: Deployment, baseline_tokens: int | None) -> Clean:
    """Run every check; ``baseline_tokens``: GetLoads' used tokens after a
    flush at the start (None: this is the start)."""
    out = Clean()
    out.idle_s, problem = wait_idle(dep)
    if problem:
        out.problems.append(problem)
    try:
        if not dep.flush():
            out.problems.append("FlushCache did not succeed while idle")
        out.used_tokens = dep.used_tokens()
    except grpc.RpcError as e:
        out.problems.append(f"FlushCache/GetLoads: {e.code().name}: {e.details()}")
    if baseline_tokens is not None and out.used_tokens != baseline_tokens:
        out.problems.append(
            f"KV pages not back: {out.used_tokens} tokens used after a flush, "
            f"{baseline_tokens} at the start"
        )
    ready = dep.readiness()
    if ready != "SERVING":
        out.problems.append(f"readiness {ready}")
    out.problems += dep.metrics_answer()
    # A zombie or a stray may need a moment to be reaped after a kill.
    for _ in range(20):
        tree = dep.tree()
        found = processes(dep, tree)
        if not found:
            break
        time.sleep(0.25)
    out.problems += found
    out.roles = dict(tree.count())
    out.rss = {f"{tree.roles[p.pid]}:{p.pid}": p.rss for p in tree.procs if p.state != "Z"}
    return out


def rss_growth(history: list[tuple[str, dict[str, int]]], limit: float, floor_mib: float):
    """Each process seen in at least two checks: its RSS at the first check
    after warm-up (the first entry) against the last; (problems, lines)."""
    problems, lines = [], []
    first_seen: dict[str, tuple[str, int]] = {}
    last_seen: dict[str, tuple[str, int]] = {}
    series: dict[str, list[int]] = {}
    for label, rss in history:
        for key, value in rss.items():
            first_seen.setdefault(key, (label, value))
            last_seen[key] = (label, value)
            series.setdefault(key, []).append(value >> 20)
    for key in sorted(first_seen):
        (l0, a), (l1, b) = first_seen[key], last_seen[key]
        if l0 == l1:
            continue
        growth = b / a - 1 if a else 0.0
        lines.append(
            f"{key}: {a / 2**20:.0f} MiB after {l0} -> {b / 2**20:.0f} MiB after {l1} "
            f"({growth:+.0%}; each phase: {series[key]})"
        )
        if growth > limit and (b - a) / 2**20 > floor_mib:
            problems.append(
                f"{key} RSS grew {growth:+.0%} ({a / 2**20:.0f} -> {b / 2**20:.0f} MiB)"
            )
    return problems, lines
