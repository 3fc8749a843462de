"""Worker loss, the engine's collaborator: drop the worker state, keep the
requests, reconnect with backoff, and give up on the requests (not on the
service) past --worker-recovery-timeout.

The engine drives it (loop.py, ``Engine._recover``): while the group is away
the engine still reads the pipe, so aborts apply and new requests queue.
Past the timeout every queued request (and every new one until the group is
back) ends with UNAVAILABLE; reconnection goes on, so the service serves
again as soon as the group returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup

logger = structlog.get_logger(__name__)

RETRY_FIRST_S = 0.25  # first reconnect attempt (a restarted worker takes seconds)
RETRY_MAX_S = 2.0  # backoff cap: a returning worker is found within this
LOG_EVERY_S = 10.0


class WorkerRecovery:
    def __init__(
        self,
        sched: Scheduler,
        group: WorkerGroup,
        timeout_s: float,
        before_open: Callable[[], None] | None = None,
    ) -> None:
        self.sched = sched
        self.group = group
        self.timeout_s = timeout_s
        # Run on the group that came back before its streams open (the LoRA
        # adapters are loaded again); WorkerError fails the attempt.
        self.before_open = before_open
        self.connected = True
        self.losses = 0  # times the group's streams broke
        self.recoveries = 0  # times it came back and serving resumed
        # The outage in progress (meaningful while not connected).
        self._lost_at = 0.0
        self._delay = RETRY_FIRST_S
        self._next_try = 0.0
        self._log_at = 0.0
        self._gave_up = False

    @property
    def message(self) -> str:
        """What the requests failed past the timeout are told."""
        return f"worker group lost and not back within {self.timeout_s:g} s"

    def lost(self, error: str) -> None:
        """The group's streams broke: forget its state, keep the requests."""
        sched = self.sched
        now = time.monotonic()
        self.losses += 1
        self.connected = False
        self._lost_at = now
        self._delay = RETRY_FIRST_S
        self._next_try = now + RETRY_FIRST_S
        self._log_at = now + LOG_EVERY_S
        self._gave_up = False
        self.group.drop_streams()
        logger.error(
            "worker group lost: dropping the KV cache, requests wait for it to come back",
            error=error,
            running=len(sched.running) + (sched.chunked is not None),
            waiting=len(sched.waiting),
            recovery_timeout_s=self.timeout_s,
        )
        sched.reset_after_worker_loss()

    def try_reconnect(self) -> bool:
        """Reconnect if an attempt is due; True once the group serves again."""
        now = time.monotonic()
        if now < self._next_try:
            return False
        log = now >= self._log_at
        if self._reconnect(log):
            logger.info(
                "worker group back: re-prefilling the interrupted requests",
                outage_s=round(time.monotonic() - self._lost_at, 2),
                waiting=len(self.sched.waiting),
                pages=self.sched.pool.num_pages,
            )
            self.connected = True
            self.recoveries += 1
            return True
        if log:
            self._log_at = now + LOG_EVERY_S
        self._delay = min(self._delay * 2, RETRY_MAX_S)
        self._next_try = time.monotonic() + self._delay
        return False

    def expired(self) -> bool:
        """Whether the outage has outlasted the timeout (logged once)."""
        if not self._gave_up and time.monotonic() - self._lost_at >= self.timeout_s:
            self._gave_up = True
            logger.error(
                "worker group not back in time: failing its requests with UNAVAILABLE "
                "(new ones too until it returns)",
                recovery_timeout_s=self.timeout_s,
                requests=len(self.sched.requests),
            )
        return self._gave_up

    def wait_s(self) -> float:
        """How long the engine may wait on its pipe before calling again."""
        wake = self._next_try
        if not self._gave_up:
            wake = min(wake, self._lost_at + self.timeout_s)
        return max(0.0, wake - time.monotonic())

    def _reconnect(self, log: bool) -> bool:
        sched = self.sched
        try:
            info = self.group.try_connect()
        except WorkerError as e:
            if log:
                logger.info("waiting for the worker group", error=str(e))
            return False
        config = sched.config
        if (info.page_size, info.model.vocab_size) != (config.page_size, config.vocab_size):
            # Another model on the same address: these requests' tokens mean
            # nothing to it. Keep waiting (the timeout ends the requests).
            logger.error(
                "the worker group came back with another model shape; not using it",
                page_size=info.page_size,
                vocab_size=info.model.vocab_size,
                expected_page_size=config.page_size,
                expected_vocab_size=config.vocab_size,
            )
            self.group.drop_streams()
            return False
        if info.num_pages != sched.pool.num_pages:
            logger.info(
                "the worker group has a new KV pool size",
                pages=info.num_pages,
                was=sched.pool.num_pages,
            )
            sched.resize_pool(info.num_pages)
        if self.before_open is not None:
            try:
                self.before_open()
            except WorkerError as e:
                if log:
                    logger.info("waiting for the worker group", error=str(e))
                self.group.drop_streams()
                return False
        self.group.open()
        return True
