"""The engine's side of worker loss: drop the worker state, keep the requests,
reconnect with backoff, and give up on the requests (not on the service) past
--worker-recovery-timeout.

While the group is away the loop still reads the pipe: aborts apply, new
requests queue. Past the timeout every queued request (and every new one
until the group is back) ends with UNAVAILABLE; reconnection goes on, so the
service serves again as soon as the group returns.
"""

from __future__ import annotations

import time

import structlog

from scheduler_service import ipc
from scheduler_service.workers import WorkerError

logger = structlog.get_logger(__name__)

RETRY_FIRST_S = 0.25  # first reconnect attempt (a restarted worker takes seconds)
RETRY_MAX_S = 2.0  # backoff cap: a returning worker is found within this
LOG_EVERY_S = 10.0


class WorkerRecoveryMixin:
    """Mixed into Engine (engine.py), whose attributes it uses."""

    recovery_timeout_s: float
    worker_connected: bool
    worker_losses: int
    worker_recoveries: int
    loss_error: str = ""  # why the streams broke (set by the engine)

    def _recover(self) -> bool:
        """Survive the loss of the worker group; True once it serves again,
        False if the service is shutting down meanwhile."""
        sched = self.sched
        lost_at = time.monotonic()
        self.worker_losses += 1
        self.worker_connected = False
        self.group.drop_streams()
        self.inflight.clear()
        self.codec.forget_worker()
        if self.tracer is not None:
            self.tracer.forget_steps()
        logger.error(
            "worker group lost: dropping the KV cache, requests wait for it to come back",
            error=self.loss_error,
            running=len(sched.running) + (sched.chunked is not None),
            waiting=len(sched.waiting),
            recovery_timeout_s=self.recovery_timeout_s,
        )
        sched.reset_after_worker_loss()
        self._publish()  # AllBlocksCleared and the load go out now
        message = f"worker group lost and not back within {self.recovery_timeout_s:g} s"
        delay, next_try, log_at = RETRY_FIRST_S, lost_at + RETRY_FIRST_S, lost_at + LOG_EVERY_S
        gave_up = False
        while self.running:
            now = time.monotonic()
            if now >= next_try:
                if self._reconnect(now >= log_at):
                    logger.info(
                        "worker group back: re-prefilling the interrupted requests",
                        outage_s=round(time.monotonic() - lost_at, 2),
                        waiting=len(sched.waiting),
                        pages=sched.pool.num_pages,
                    )
                    self.worker_connected = True
                    self.worker_recoveries += 1
                    return True
                if now >= log_at:
                    log_at = now + LOG_EVERY_S
                delay = min(delay * 2, RETRY_MAX_S)
                next_try = time.monotonic() + delay
            if not gave_up and time.monotonic() - lost_at >= self.recovery_timeout_s:
                gave_up = True
                logger.error(
                    "worker group not back in time: failing its requests with UNAVAILABLE "
                    "(new ones too until it returns)",
                    recovery_timeout_s=self.recovery_timeout_s,
                    requests=len(sched.requests),
                )
            if gave_up:
                self._fail_all(message)
            wake = next_try if gave_up else min(next_try, lost_at + self.recovery_timeout_s)
            self._read_inbox(block=True, timeout=max(0.0, wake - time.monotonic()))
        return False

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
        self.group.open()
        return True

    def _fail_all(self, message: str) -> None:
        """End every request the core holds (and held siblings) with UNAVAILABLE."""
        sched = self.sched
        rids = []
        for rid in list(sched.requests):
            req = sched.requests[rid]
            sched.abort(rid, message, emit=False)  # the call ends with a status, not a finish
            self._finished(req)
            rids.append(rid)
            self.codec.traces.pop(rid, None)
        for siblings in self.held.values():
            rids.extend(r.rid for r in siblings)
            for r in siblings:
                self.codec.traces.pop(r.rid, None)
        self.held.clear()
        if rids:
            self.conn.send(ipc.Unavailable(rids, message))
