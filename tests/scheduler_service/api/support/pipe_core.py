"""A core process stand-in at the far end of a real multiprocessing Pipe, in
this process.

The API process's modules see what they see of a spawned core
(api/core_process.py): messages pickled through a pipe, drained by a thread
of their own, delivered on the event loop in order, and the exit reported
once the pipe closes. The test speaks for the core: it reads what the API
process sent and answers with Ready, Outputs, Rejected, Flushed, Failed or a
death. No process starts, so these tests belong to the fast lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from scheduler_service import ipc
from scheduler_service.core.kv.events import KvEvent

KILLED = "killed by signal 9, SIGKILL"
RECEIVE_TIMEOUT_S = 5.0


class PipeCore:
    """Stands in for ``CoreProcess``: ``start``/``send``/``stop``/``gone``
    as the CoreSupervisor uses them; ``say``/``receive``/``die`` for the test."""

    pids = itertools.count(1000)

    def __init__(
        self,
        on_message: Callable[[PipeCore, object], None],
        on_exit: Callable[[PipeCore, str], None],
    ) -> None:
        self.on_message, self.on_exit = on_message, on_exit
        self.pid = next(self.pids)
        self.started_at = 0.0
        self.conn: Connection | None = None  # the API process's end
        self.far: Connection | None = None  # the core's end (the test's)
        self.how = "exited"  # what the API process hears once the pipe closes
        self.stopped = False

    # --------------------------------------------- as CoreProcess is used
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.far = multiprocessing.Pipe()
        self.started_at = time.monotonic()
        threading.Thread(target=self._read, args=(loop,), daemon=True, name="pipe").start()

    def send(self, msg: object) -> None:
        self.conn.send(msg)

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped = True
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(ipc.Shutdown())
        self._close_far()

    async def gone(self, grace_s: float) -> None:
        self.stopped = True
        self._close_far()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                self._post(loop, self.on_message, self.conn.recv())
        except (EOFError, OSError):
            pass
        self._post(loop, self.on_exit, self.how)

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable, arg: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(fn, self, arg)

    def _close_far(self) -> None:
        if self.far is not None and not self.far.closed:
            self.far.close()

    # ------------------------------------------------------ the core's side
    def say(self, msg: object) -> None:
        self.far.send(msg)

    async def receive(self, timeout_s: float = RECEIVE_TIMEOUT_S) -> object:
        """The next message the API process sent."""
        if not await asyncio.to_thread(self.far.poll, timeout_s):
            raise TimeoutError(f"the API process sent the core nothing in {timeout_s} s")
        return self.far.recv()

    async def receive_kind(self, kind: type, timeout_s: float = RECEIVE_TIMEOUT_S):
        """The next message of ``kind``, skipping others (e.g. health probes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await self.receive(max(deadline - time.monotonic(), 0.0))
            if isinstance(msg, kind):
                return msg

    async def nothing_sent(self, wait_s: float = 0.1) -> bool:
        return not await asyncio.to_thread(self.far.poll, wait_s)

    async def rest(self, wait_s: float = 0.1) -> list[object]:
        """Everything sent and not yet received, once ``wait_s`` passes quietly."""
        out = []
        while await asyncio.to_thread(self.far.poll, wait_s):
            out.append(self.far.recv())
        return out

    def die(self, how: str = KILLED) -> None:
        """The core goes away: its pipe closes, the API process hears ``how``."""
        self.how = how
        self._close_far()


# ------------------------------------------------------ what the core says
def ready(model: str = "m", vocab_size: int = 100, max_context_len: int = 512) -> ipc.Ready:
    return ipc.Ready(
        model_name=model,
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        eos_token_ids=[2],
        max_context_len=max_context_len,
        page_size=4,
        num_pages=256,
        tp_size=1,
        tokenizer_zip=b"",
        worker_info={},
    )


def load(**fields) -> ipc.Load:
    base = dict(
        running=0,
        waiting=0,
        used_tokens=0,
        total_tokens=1024,
        cache_hit_rate=0.0,
        gen_tokens=0,
        steps=0,
        worker_busy_ms=0.0,
        worker_idle_ms=0.0,
        core_cpu_s=0.0,
        max_running_requests=8,
    )
    return ipc.Load(**(base | fields))


def tokens(*pairs: tuple[str, int], events: list[KvEvent] | None = None) -> ipc.Outputs:
    """One step's plain tokens as the core sends them: the flat columns."""
    return ipc.Outputs(
        deltas=[],
        load=load(),
        events=events or [],
        rids=[rid for rid, _ in pairs],
        tokens=[t for _, t in pairs],
        cached=[0] * len(pairs),
    )


def finish(rid: str, token: int, kind: str = "length") -> ipc.Outputs:
    """A sample's last token and its finish (a delta of its own)."""
    return ipc.Outputs(deltas=[ipc.DeltaOut(rid, [token], finish=ipc.Finish(kind))], load=load())
