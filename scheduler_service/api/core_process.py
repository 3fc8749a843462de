"""One spawned core process, seen from the API process: its pipe, the thread
that drains the pipe, and how the process ended.

The CoreClient (core_client.py) starts one and, when it dies, a successor;
this object knows nothing of calls. It is started from the event loop's
thread, which lives as long as the API process serves: the core's
PR_SET_PDEATHSIG (common/lifeline.py, armed first thing in ``core_main``)
follows the thread that forked it, not the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import structlog

from scheduler_service import ipc

logger = structlog.get_logger(__name__)

EXIT_WAIT_S = 2.0  # after the pipe closed, how long to wait for the exit status


def describe_exit(code: int | None) -> str:
    """A process's exit status in words, for a message a person reads."""
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by signal {-code}, {name}"
    return "exited" if code == 0 else f"exited with status {code}"


class CoreProcess:
    """``on_message(self, msg)`` and ``on_exit(self, how)`` run on the event
    loop, in the order the pipe delivered them; ``on_exit`` comes last, once
    the pipe closed, with the exit status in words."""

    def __init__(
        self,
        target: Callable,
        args: tuple,
        on_message: Callable[[CoreProcess, object], None],
        on_exit: Callable[[CoreProcess, str], None],
    ) -> None:
        self.target, self.args = target, args
        self.on_message, self.on_exit = on_message, on_exit
        self.process: multiprocessing.Process | None = None
        self.conn: Connection | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        # Our pid goes along: a core that starts after we died kills itself.
        args = (theirs, *self.args, os.getpid())
        self.process = ctx.Process(target=self.target, args=args, name="core")
        self.process.start()
        self.started_at = time.monotonic()
        theirs.close()
        self.conn = ours
        reader = threading.Thread(target=self._read, args=(loop,), daemon=True, name="pipe")
        reader.start()

    def send(self, msg: object) -> None:
        self.conn.send(msg)

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drain the pipe on a thread of its own: however busy the event loop
        is with client streams, the core process never finds the pipe full."""
        conn = self.conn
        try:
            while True:
                msg = conn.recv()
                self._post(loop, self.on_message, msg)
        except (EOFError, OSError):
            pass
        # The core exits right after its pipe closes; its status says why
        # (a signal, a crash) in the message the calls and the log get.
        self.process.join(EXIT_WAIT_S)
        self._post(loop, self.on_exit, describe_exit(self.process.exitcode))

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable, arg: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(fn, self, arg)

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask it to stop (``ipc.Shutdown``), then make sure it has: SIGTERM,
        then SIGKILL, each after ``grace_s``."""
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(ipc.Shutdown())
        self.ensure_gone(grace_s)

    def ensure_gone(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for it to exit, then SIGTERM, then SIGKILL."""
        proc = self.process
        if proc is None:
            return
        proc.join(grace_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()

    async def gone(self, grace_s: float) -> None:
        """``ensure_gone`` without blocking the event loop."""
        proc = self.process
        if proc is None:
            return
        deadline = time.monotonic() + grace_s
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join)
        proc.join(0)
