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
never steps delayed.
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
from collections import deque

import structlog

from common.lifeline import child_env
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
        self._pending: deque = deque()
        self._closing = threading.Event()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "worker_service.telemetry.span_process", str(rank)],
            stdin=subprocess.PIPE,
            env=child_env(),  # it dies with this worker (lifeline.py)
        )
        self._thread = threading.Thread(target=self._pipe, daemon=True, name="step-spans")
        self._thread.start()
        tracing.before_shutdown(self.close)

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
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self.dropped:
            logger.warning("step spans dropped: the span process fell behind", dropped=self.dropped)

    def _pipe(self) -> None:
        out = self._proc.stdin
        pending = self._pending
        try:
            while True:
                closing = self._closing.wait(PIPE_EVERY_S)
                batch = []
                while pending:
                    item = pending.popleft()
                    if item != RESET:
                        plan, *rest = item
                        item = (plan.SerializeToString(), *rest)
                    batch.append(item)
                if batch:
                    pickle.dump(batch, out, protocol=pickle.HIGHEST_PROTOCOL)
                    out.flush()
                if closing:
                    return
        except (BrokenPipeError, OSError) as e:
            logger.warning("the step span process is gone", error=str(e))
        finally:
            with contextlib.suppress(OSError):
                out.close()
