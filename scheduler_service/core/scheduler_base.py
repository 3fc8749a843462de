"""State shared by the scheduler's parts, and the moves every part needs.

``Scheduler`` (scheduler.py) is assembled from this base and mixins, as
SGLang assembles its scheduler: ``AdmissionMixin`` (admission.py, prefill
steps), ``RetractionMixin`` (retraction.py, decode steps and putting
requests back to wait) and ``WorkerLossMixin`` (worker_loss.py, starting
over when the worker group is lost).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.finish import StopStringChecker
from scheduler_service.core.kv_ownership import KvManager
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.page_pool import PagePool
from scheduler_service.core.policy import SchedulePolicy
from scheduler_service.core.radix_cache import RadixCache
from scheduler_service.core.request import FinishReason, Request, RequestState


class ProtocolError(RuntimeError):
    """A step result that does not fit the plan it answers."""


@dataclass(slots=True)
class InFlight:
    """What the scheduler remembers of a plan until its result comes back."""

    step_id: int
    # rid -> (request, its epoch when planned, whether the entry samples)
    entries: dict[str, tuple[Request, int, bool]]
    expected_tokens: int
    # Requests whose prefill completes in this step without sampling
    # (max_new_tokens == 0): they finish when the step's result arrives.
    prefill_only: list[tuple[Request, int]] = field(default_factory=list)


class SchedulerBase:
    def __init__(
        self,
        config: SchedulerConfig,
        num_pages: int,
        stop_strings: StopStringChecker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.cache = RadixCache(config.page_size, self.pool, enable_events=config.enable_kv_events)
        self.kv = KvManager(self.pool, self.cache)
        self.policy = SchedulePolicy(config, self.cache)
        self.running = RunningBatch(self.kv)
        self.waiting: list[Request] = []
        self.chunked: Request | None = None
        self.requests: dict[str, Request] = {}
        self.new_token_ratio = config.start_new_token_ratio
        self.stats = SchedulerStats()
        self._stop_strings = stop_strings
        self._clock = clock
        self._step_id = 0
        self._inflight: deque[InFlight] = deque()
        self._leaves: list[str] = []
        self._outbox: list[RequestDelta] = []
        self._admission_stuck = False
        # Told (request, "retraction" | "preemption") whenever a running
        # request is sent back to wait; the service's tracing listens.
        self.on_requeue: Callable[[Request, str], None] | None = None

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _take_leaves(self) -> list[str]:
        leaves, self._leaves = self._leaves, []
        return leaves

    def _preempt(self, req: Request) -> None:
        """Send a running request back to wait for a higher-priority one
        (RetractionMixin implements it; admission calls it)."""
        raise NotImplementedError

    def _leave(self, req: Request) -> None:
        if req.on_worker:
            self._leaves.append(req.rid)
            req.on_worker = False

    def _finish(self, req: Request, reason: FinishReason, emit: bool = True) -> None:
        """Finish ``req`` wherever it is, cache its tokens and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req.state in (RequestState.WAITING, RequestState.RETRACTED):
            self.waiting.remove(req)
        self.kv.release(req, cache_tokens=True)
        self._leave(req)
        req.finish(reason, self._clock())
        del self.requests[req.rid]
        kinds = self.stats.finished
        kinds[reason.kind] = kinds.get(reason.kind, 0) + 1
        if emit:
            self._outbox.append(RequestDelta(req, [], finished=True))
