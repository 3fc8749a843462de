"""Grammars that take a while to compile, and /proc readings of the processes
that compile them, for the compile pool's tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

TINY_SCHEMA = (
    '{"type": "object", "properties": {"t4242": {"type": "integer"}}, "required": ["t4242"]}'
)


def nested_schema(depth: int, tag: str) -> str:
    """A JSON schema of objects nested ``depth`` deep (one required property
    each). xgrammar's compile time grows about as depth^3: on a 2-core
    machine, alone, 100 deep takes 0.1-0.2 s, 300 about 3 s, 400 about 7-9 s
    (and as long again to serialize), whatever the vocabulary's size."""
    schema = '{"type": "integer"}'
    for i in range(depth):
        key = f"{tag}{i}"
        schema = f'{{"type": "object", "properties": {{"{key}": {schema}}}, "required": ["{key}"]}}'
    return schema


def state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu_s(pid: int) -> float:
    return cpu_s(pid) + sum(cpu_s(p) for p in descendants(pid))


def wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until ``pid`` left /proc, or None if it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while state(pid) is not None:
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.02)
    return time.monotonic() - t0


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
