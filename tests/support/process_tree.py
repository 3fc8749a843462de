"""Processes as Linux's /proc shows them: a process's descendants (to check
that none outlives it) and whether a pid still runs."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str  # R, S, D, Z, ...
    start: int  # clock ticks after boot: tells a pid's reuse apart
    cmdline: str


def read(pid: int) -> Proc | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    # the command name, in parentheses, may hold spaces and parentheses itself
    fields = stat[stat.rindex(")") + 2 :].split()
    cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return Proc(pid, int(fields[1]), fields[0], int(fields[19]), cmdline)


def processes() -> list[Proc]:
    found = (read(int(p.name)) for p in PROC.iterdir() if p.name.isdigit())
    return [p for p in found if p is not None]


def descendants(pid: int) -> list[Proc]:
    """Every living process below ``pid`` (children, theirs, ...)."""
    by_parent: dict[int, list[Proc]] = {}
    for p in processes():
        by_parent.setdefault(p.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child.state != "Z":
                out.append(child)
            todo.append(child.pid)
    return out


def running(p: Proc) -> bool:
    """Whether ``p`` still runs: not gone, not a zombie (an orphan's zombie
    waits for a PID 1 that may never reap it, but it holds nothing), not
    another process that got its pid."""
    now = read(p.pid)
    return now is not None and now.state != "Z" and now.start == p.start


def still_running(procs: list[Proc], timeout_s: float) -> list[Proc]:
    """Those of ``procs`` that still run after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def me() -> Proc:
    p = read(os.getpid())
    assert p is not None
    return p
