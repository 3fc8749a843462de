"""The worker's grammar compile pool: grammars compiled in child processes
(grammar_zygote.py), never on the worker's gRPC or executing threads; at most
``processes`` at a time, in lanes so that hard grammars delay only their own
requests (grammar_lanes.py); a compile nobody waits for any more (its
deadline passed, its RPC was cancelled) is SIGKILLed at once, so it stops
using CPU.

One manager thread ("grammar-pool") owns the processes: it starts the
zygote, forks children, sends them grammars, pauses, resumes and kills them,
reads their answers and hands them to the callers. A caller
(``CompileGrammar`` on a gRPC thread) holds a ``Ticket`` while it waits; at
most ``max_waiting`` tickets exist at a time, one more is refused at once
(``PoolFull``), so at most that many gRPC threads ever wait on compiles.
Tickets for one grammar share its job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import structlog

from worker_service.sampling.grammar_lanes import (
    SLOW_S,
    LaneJob,
    LaneState,
    Moves,
    next_slow_at,
    plan_lanes,
)
from worker_service.sampling.grammar_procs import Child, Zygote

logger = structlog.get_logger(__name__)

IDLE_WAKE_S = 5.0  # the manager looks around at least this often


class PoolFull(RuntimeError):
    """Too many compiles waiting on this worker: retry later."""


@dataclass
class Outcome:
    """How a compile ended: ``payload`` (it compiled), ``error`` (it does not
    compile: a verdict), or ``failure`` (no verdict: it timed out, was
    cancelled, its process died, the pool closed)."""

    payload: bytes = b""
    error: str = ""
    failure: str = ""
    timed_out: bool = False
    ms: float = 0.0


@dataclass(eq=False)
class _Job:
    key: tuple[str, str]
    lane: LaneJob
    deadline: float  # monotonic; the latest of its tickets'
    waiters: int = 0
    outcome: Outcome | None = None
    done: threading.Event = field(default_factory=threading.Event)
    child: Child | None = None


class Ticket:
    """One caller's wait for a job."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.released = False

    @property
    def pid(self) -> int | None:
        """The process compiling the job now, if any (tests, diagnostics)."""
        child = self.job.child
        return None if child is None else child.pid

    def wait(self, timeout: float) -> Outcome | None:
        """The outcome, or None if it did not come within ``timeout`` seconds."""
        if not self.job.done.wait(max(timeout, 0.0)):
            return None
        return self.job.outcome


class CompilePool:
    def __init__(
        self,
        info_json: Callable[[], str],
        processes: int = 2,
        max_waiting: int = 16,
        slow_s: float = SLOW_S,
    ) -> None:
        self._info_json = info_json
        self.processes = max(1, processes)
        self.max_waiting = max(1, max_waiting)
        self.slow_s = slow_s
        self._lock = threading.Lock()  # jobs, tickets; the manager's plans
        self._jobs: dict[tuple[str, str], _Job] = {}  # active, or done with waiters
        self._active: list[_Job] = []  # not done
        self._tickets = 0
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # The manager thread's own:
        self._zygote: Zygote | None = None
        self._info: str | None = None
        self._children: list[Child] = []

    # ------------------------------------------------------------ callers
    def submit(self, kind: str, text: str, deadline: float) -> Ticket:
        """Wait for ``(kind, text)`` to compile until ``deadline`` (monotonic)."""
        key = (kind, text)
        with self._lock:
            if self._closed:
                raise PoolFull("the grammar compile pool is closed")
            if self._tickets >= self.max_waiting:
                raise PoolFull(
                    f"{self._tickets} grammar compiles already waiting on this worker "
                    "(--grammar-compile-queue); retry later"
                )
            job = self._jobs.get(key)
            if job is not None and job.outcome is not None and job.outcome.failure:
                job = None  # ended without a verdict: try again
            if job is None:
                self._seq += 1
                job = _Job(key, LaneJob(self._seq, len(text.encode())), deadline)
                self._jobs[key] = job
                self._active.append(job)
            job.waiters += 1
            job.deadline = max(job.deadline, deadline)
            self._tickets += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="grammar-pool", daemon=True)
                self._thread.start()
        self._wake()
        return Ticket(job)

    def release(self, ticket: Ticket) -> None:
        """The caller stopped waiting (answered, timed out or cancelled); a job
        no one waits for any more is ended. Idempotent."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._tickets -= 1
            job = ticket.job
            job.waiters -= 1
            if job.waiters == 0 and job.done.is_set() and self._jobs.get(job.key) is job:
                del self._jobs[job.key]
        self._wake()

    def waiting(self) -> int:
        with self._lock:
            return self._tickets

    def process_ids(self) -> tuple[int | None, list[int]]:
        """(the zygote's pid, the children's): for tests and diagnostics."""
        with self._lock:
            zygote = self._zygote.proc.pid if self._zygote is not None else None
            return zygote, [c.pid for c in self._children]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(10)
            if thread.is_alive():
                return  # stuck (a daemon thread): it stops its processes when it returns
        self._stop_processes()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # already awake (the pipe is full), or closed
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------ the manager
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                self._step()
        except Exception:
            logger.exception("grammar compile pool failed; it restarts with the next compile")
        finally:
            self._stop_processes()

    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            for job in list(self._active):
                if job.waiters == 0:
                    self._end(job, Outcome(failure="nobody waits for it any more"), "cancelled")
                elif now >= job.deadline:
                    self._end(job, Outcome(failure="timed out", timed_out=True), "timed out")
            want_zygote = any(j.lane.state is LaneState.WAITING for j in self._active)
        if want_zygote and (self._zygote is None or self._zygote.dead):
            self._start_zygote()
        if self._zygote is not None and self._zygote.ready and not self._zygote.dead:
            with self._lock:
                self._apply(plan_lanes((j.lane for j in self._active), self.processes, now))
        self._listen(now)

    def _start_zygote(self) -> None:
        if self._zygote is not None:
            self._drop_zygote("the grammar compile processes stopped")
        try:
            if self._info is None:
                self._info = self._info_json()
            self._zygote = Zygote(self._info)
        except Exception as e:
            logger.exception("cannot start the grammar compile processes")
            self._fail_all(f"cannot start the grammar compile processes: {e}")
            return
        logger.info("grammar compile processes starting", zygote=self._zygote.proc.pid)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            for job in list(self._active):
                self._end(job, Outcome(failure=why), "")

    def _drop_zygote(self, why: str) -> None:
        """The zygote is gone: so are its children (lifelines); their jobs fail."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()
        with self._lock:
            for child in list(self._children):
                job = child.job
                self._kill(child)
                if job is not None and not job.done.is_set():
                    self._end(job, Outcome(failure=why), "")

    def _apply(self, moves: Moves) -> None:  # under the lock
        for lane in moves.pause:
            job = self._job_of(lane)
            job.child.signal(signal.SIGSTOP)
            lane.state = LaneState.PAUSED
            logger.info("grammar compile paused", bytes=lane.size, waited_s=self._age(lane))
        for lane in moves.resume:
            job = self._job_of(lane)
            job.child.signal(signal.SIGCONT)
            lane.state = LaneState.RUNNING
        for lane in moves.start:
            job = self._job_of(lane)
            child = self._idle_child()
            if child is None:
                return  # the zygote failed; it is restarted next round
            try:
                child.send(*job.key)
            except OSError:
                self._kill(child)
                continue
            child.job, job.child = job, child
            lane.state = LaneState.RUNNING
            lane.started_at = time.monotonic()

    def _age(self, lane: LaneJob) -> float:
        return round(time.monotonic() - (lane.started_at or time.monotonic()), 2)

    def _job_of(self, lane: LaneJob) -> _Job:
        for job in self._active:
            if job.lane is lane:
                return job
        raise KeyError(lane)

    def _idle_child(self) -> Child | None:
        for child in self._children:
            if child.job is None:
                return child
        try:
            child = self._zygote.fork()
        except (OSError, EOFError):
            return None
        self._children.append(child)
        return child

    def _kill(self, child: Child) -> None:  # under the lock
        child.kill()
        if child in self._children:
            self._children.remove(child)
        if child.job is not None:
            child.job.child = None
            child.job = None

    def _end(self, job: _Job, outcome: Outcome, why: str) -> None:  # under the lock
        """Hand ``outcome`` to the job's callers; its process, if it still runs
        one, is killed."""
        if job.child is not None:
            if why:
                logger.info(
                    "grammar compile stopped",
                    why=why,
                    bytes=job.lane.size,
                    ran_s=self._age(job.lane),
                    pid=job.child.pid,
                )
            self._kill(job.child)
        job.outcome = outcome
        job.done.set()
        if job in self._active:
            self._active.remove(job)
        if job.waiters == 0 and self._jobs.get(job.key) is job:
            del self._jobs[job.key]

    def _listen(self, now: float) -> None:
        """Wait for an answer, a caller, the zygote or the next timed event."""
        with self._lock:
            times = [j.deadline for j in self._active]
            slow = next_slow_at((j.lane for j in self._active), now, self.slow_s)
            children = list(self._children)
        if slow is not None:
            times.append(slow)
        timeout = min([*times, now + IDLE_WAKE_S]) - now
        sources: list = [self._wake_r, *(c.conn for c in children)]
        if self._zygote is not None and not self._zygote.dead:
            sources.append(self._zygote)
        for ready in wait(sources, max(timeout, 0.0)):
            if ready == self._wake_r:
                os.read(self._wake_r, 4096)
            elif ready is self._zygote:
                self._zygote.readable()
                if self._zygote.dead:
                    started = self._zygote.ready
                    self._drop_zygote("the grammar compile processes stopped")
                    if not started:  # not again and again: the next compile tries
                        logger.error("the grammar compile processes did not start")
                        self._fail_all("the grammar compile processes did not start")
            else:
                self._answer(next(c for c in children if c.conn is ready))

    def _answer(self, child: Child) -> None:
        """Read what ``child`` says: its job's outcome, or end-of-file."""
        try:
            error, ms, payload = child.answer()
            outcome: Outcome | None = Outcome(payload=payload, error=error, ms=ms)
        except (EOFError, OSError, ValueError, KeyError):
            outcome = None
        with self._lock:
            job = child.job
            if child not in self._children:
                return  # killed meanwhile
            if job is None or outcome is None:
                self._kill(child)  # an idle child that ended, or one that died mid-job
                if job is not None and not job.done.is_set():
                    self._end(job, Outcome(failure="the compile process ended"), "")
                return
            worn = job.lane.slow(time.monotonic(), self.slow_s)
            child.job, job.child = None, None
            self._end(job, outcome, "")
            idle = sum(1 for c in self._children if c.job is None)
            if worn or idle > self.processes:
                self._kill(child)

    def _stop_processes(self) -> None:
        self._drop_zygote("the grammar compile pool stopped")
        self._fail_all("the grammar compile pool stopped")
