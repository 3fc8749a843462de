"""The `server` marker, enforced: a test that starts a process running beside
it must say so, so that `make test-fast` (``-m "not server"``) can trust the
marks instead of hoping for them.

A test may run a command to completion (``subprocess.run``, ``check_output``,
``call``, ``check_call``, ``os.system``, and the library lookups of
``ctypes.util``): the command is over when the call returns, so nothing runs
beside the test. Anything else that starts a process (``Popen`` kept by the
test, a ``multiprocessing`` child, ``os.fork``, ``os.posix_spawn``) fails the
test unless it is marked ``server`` (or ``gpu``: those never run in the CPU
lane). The start is refused at once, and the test is failed afterwards too, in
case the code under test caught the refusal.

Every process start goes through one of three doors, watched here: the
``subprocess.Popen``, ``os.fork``, ``os.forkpty`` and ``os.posix_spawn`` audit
events; ``_posixsubprocess.fork_exec`` as ``multiprocessing`` calls it (its
spawn and forkserver helpers raise no audit event); and ``BaseProcess.start``
(a forkserver's children are forked by the forkserver, not by us).
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

EXEMPT_MARKERS = ("server", "gpu")

_AUDITED = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp"}
)

# Calls that return only once the command has exited.
_ONE_SHOT: frozenset[CodeType] = frozenset(
    f.__code__
    for f in (
        subprocess.run,
        subprocess.call,
        subprocess.check_call,
        subprocess.check_output,
        subprocess.getoutput,
        subprocess.getstatusoutput,
    )
)
_CTYPES_UTIL = os.path.join("ctypes", "util.py")


class ProcessStartRefused(RuntimeError):
    """A test not marked `server` started a process that runs beside it."""


@dataclass
class _Guard:
    item: pytest.Item | None = None
    allowed: bool = True
    # Starts refused (or seen) per test id, reported by the phase that saw them.
    seen: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_guard = _Guard()


def _one_shot() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _ONE_SHOT or frame.f_code.co_filename.endswith(_CTYPES_UTIL):
            return True
        frame = frame.f_back
    return False


def _check(what: str) -> None:
    item = _guard.item
    if item is None or _guard.allowed or _one_shot():
        return
    with _guard.lock:
        _guard.seen.setdefault(item.nodeid, []).append(what)
    raise ProcessStartRefused(
        f"{item.nodeid} started a process ({what}) and is not marked server: mark it "
        "@pytest.mark.server (it then runs only in `make test`, not `make test-fast`), "
        "or run the command to completion with subprocess.run"
    )


def _short(command: Any) -> str:
    if isinstance(command, (str, bytes, os.PathLike)):
        return os.fsdecode(command)
    parts = [
        os.fsdecode(p) if isinstance(p, (str, bytes, os.PathLike)) else str(p)
        for p in command or ()
    ]
    return " ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _AUDITED:
        # subprocess.Popen's arguments are (executable, args, cwd, env).
        command = args[1] if event == "subprocess.Popen" else args[:1]
        _check(f"{event} {_short(command)}")


def _watch_fork_exec(original: Callable[..., int]) -> Callable[..., int]:
    def fork_exec(*args: Any, **kwargs: Any) -> int:
        _check(f"multiprocessing helper {_short(args[0] if args else None)}")
        return original(*args, **kwargs)

    return fork_exec


def _watch_start(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def start(self: Any) -> None:
        _check(f"multiprocessing child {self.name}")
        original(self)

    return start


_installed = False


def install() -> None:
    """Watch process starts (once per interpreter: audit hooks cannot be
    removed, so a second install would double every check)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.addaudithook(_audit)
    _posixsubprocess.fork_exec = _watch_fork_exec(_posixsubprocess.fork_exec)
    base = multiprocessing.process.BaseProcess
    base.start = _watch_start(base.start)


def _is_server_path(path: Path, tests_root: Path) -> bool:
    # Every end-to-end test talks to served processes (its fixtures start them).
    return path.is_relative_to(tests_root / "e2e")


class ProcessGuardPlugin:
    """Marks tests/e2e/ as `server` and fails unmarked tests that start a
    process; registered by tests/conftest.py."""

    def __init__(self, tests_root: Path) -> None:
        self.tests_root = tests_root

    @pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if _is_server_path(item.path, self.tests_root):
                item.add_marker(pytest.mark.server)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        # Restored after, not cleared: a test may run a pytest session inside
        # itself (tests/test_process_guard.py), and starts between tests
        # (collection, session teardown) are nobody's.
        before = _guard.item, _guard.allowed
        _guard.item = item
        _guard.allowed = any(item.get_closest_marker(m) for m in EXEMPT_MARKERS)
        try:
            yield
        finally:
            _guard.item, _guard.allowed = before

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        with _guard.lock:
            seen = _guard.seen.pop(item.nodeid, None)
        if seen and report.passed:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} started processes without the server mark "
                f"(refused, and the refusal was caught): {seen}"
            )
