"""Worker step spans, linked to the spans of the requests in each batch.

A join carries its request's span context (the scheduler's ``Generate``
span). Each step that computes at least one traced request becomes a span
``radixserve.worker.step`` with a link to every traced request in the batch;
it is a child of the first traced request of the batch (plan order), so it
shows in that request's trace, and every other request reaches it through
its link. Untraced batches make no spans.

Building and exporting spans with hundreds of links is Python work that
would hold the worker's GIL while steps run, so it happens in a process of
its own (``python -m worker_service.telemetry.span_process``): the executing
thread appends the plan and two clock readings to a list (no lock, no
wake-up), and a thread here pipes what accumulated every PIPE_EVERY_S, in
one write. If that process falls behind, spans are dropped (and counted),
never steps delayed. If it dies (killed, out of memory), the thread reaps it
and starts another after a backoff (common/restart_backoff.py); the steps
queued meanwhile (up to MAX_QUEUED) go to the new one, whose first spans
are of requests that joined after the loss (the lost process held the
older ones' trace contexts).
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
import time
from collections import deque

import structlog

from common.lifeline import child_env
from common.restart_backoff import RestartBackoff
from observability import tracing
from protos import worker_pb2 as pb

logger = structlog.get_logger(__name__)

MAX_QUEUED = 4096  # steps waiting to be piped before spans are dropped
PIPE_EVERY_S = 0.05
RESET = "reset"


class StepTracer:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.dropped = 0
        self.restarts = 0
        self._pending: deque = deque()
        self._closing = threading.Event()
        self._backoff = RestartBackoff()
        self._proc: subprocess.Popen | None = None
        self._started_at = 0.0
        self._start()
        self._thread = threading.Thread(target=self._pipe, daemon=True, name="step-spans")
        self._thread.start()
        tracing.before_shutdown(self.close)

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "worker_service.telemetry.span_process", str(self.rank)],
            stdin=subprocess.PIPE,
            env=child_env(),  # it dies with this worker (lifeline.py)
        )
        self._started_at = time.monotonic()

    def step(self, plan: pb.StepPlan, start_ns: int, end_ns: int, forward_ms: float) -> None:
        if len(self._pending) < MAX_QUEUED:
            self._pending.append((plan, start_ns, end_ns, forward_ms))
        else:
            self.dropped += 1

    def reset(self) -> None:
        """A new Execute stream: slots start over."""
        self._pending.append(RESET)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then let the span process flush and exit."""
        self._closing.set()
        self._thread.join(timeout_s)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self.dropped:
            logger.warning("step spans dropped: the span process fell behind", dropped=self.dropped)

    def _pipe(self) -> None:
        restart_at = 0.0
        try:
            while True:
                closing = self._closing.wait(PIPE_EVERY_S)
                if self._proc is None and not closing and time.monotonic() >= restart_at:
                    self._start()
                    self.restarts += 1
                    logger.warning("the step span process restarted", pid=self._proc.pid)
                if self._proc is not None and not self._send():
                    restart_at = time.monotonic() + self._lost()
                if closing:
                    return
        finally:
            self._finish()

    def _send(self) -> bool:
        """Pipe what accumulated; False if the span process is gone."""
        if self._proc.poll() is not None:
            return False
        batch = []
        while self._pending:
            item = self._pending.popleft()
            if item != RESET:
                plan, *rest = item
                item = (plan.SerializeToString(), *rest)
            batch.append(item)
        if not batch:
            return True
        try:
            pickle.dump(batch, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.dropped += len(batch)
            return False
        return True

    def _lost(self) -> float:
        """Reap the dead span process (no zombie); the wait before the next."""
        proc, self._proc = self._proc, None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        code = proc.wait()
        delay = self._backoff.delay(time.monotonic() - self._started_at)
        logger.warning(
            "the step span process is gone; starting another",
            exit_code=code,
            restart_in_s=delay,
            dropped=self.dropped,
        )
        return delay

    def _finish(self, timeout_s: float = 10.0) -> None:
        """End of input, and wait for the flush here: a span process this
        thread started gets its death signal when this thread ends."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
