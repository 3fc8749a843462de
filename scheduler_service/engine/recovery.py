"""Worker loss, the engine's collaborator: drop the worker state, keep the
requests, reconnect with backoff, and give up on the requests (not on the
service) past --worker-recovery-timeout.

The engine drives it (loop.py, ``Engine._recover``): while the group is away
the engine still reads the pipe, so aborts apply and new requests queue.
Past the timeout every queued request (and every new one until the group is
back) ends with UNAVAILABLE; reconnection goes on, so the service serves
again as soon as the group returns.

The outage clock runs from the first loss until the group has stayed up for
SETTLE_S: a flapping group (it comes back and is lost again, and again) is
one outage, so requests never wait past the timeout however often it
reconnects. A step that a worker fails (an error result) is a loss too;
the requests of its plan are charged with it, and one charged
MAX_STEP_FAILURES times is failed alone, with the worker's error.
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
# Up this long after coming back: a later loss starts a new outage (and clock).
SETTLE_S = 10.0
# Failed steps a request may be part of before it is failed (2 retries).
MAX_STEP_FAILURES = 3


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
        # The outage in progress (meaningful while not connected): it started
        # at the first loss after the group had settled.
        self._lost_at = 0.0
        self._back_at: float | None = None  # when the group last came back
        self._flaps = 0  # losses in this outage after the first
        self._strikes: dict[str, tuple[object, int]] = {}  # rid -> (request, failed steps)
        self._delay = RETRY_FIRST_S
        self._next_try = 0.0
        self._log_at = 0.0
        self._gave_up = False
        self._refused = ""  # the last session refusal logged

    @property
    def message(self) -> str:
        """What the requests failed past the timeout are told."""
        message = f"worker group lost and not back within {self.timeout_s:g} s"
        if self._flaps:
            message += (
                f" (it came back {self._flaps} times since the first loss but never stayed "
                f"up for {SETTLE_S:g} s)"
            )
        return message

    def lost(self, error: str) -> None:
        """The group's streams broke: forget its state, keep the requests."""
        sched = self.sched
        now = time.monotonic()
        self.losses += 1
        self.connected = False
        if self._back_at is None or now - self._back_at >= SETTLE_S:
            self._lost_at = now  # a new outage: its clock starts
            self._gave_up = False
            self._flaps = 0
        else:
            self._flaps += 1  # the group did not settle: the same outage goes on
        self._delay = RETRY_FIRST_S
        self._next_try = now + RETRY_FIRST_S
        self._log_at = now + LOG_EVERY_S
        self.group.drop_streams()
        running, waiting, _ = sched.table_sizes()
        logger.error(
            "worker group lost: dropping the KV cache, requests wait for it to come back",
            error=error,
            outage_s=round(now - self._lost_at, 2),
            flaps=self._flaps,
            running=running,
            waiting=waiting,
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
                waiting=self.sched.table_sizes()[1],
                pages=self.sched.kv_snapshot()[2],
            )
            self.connected = True
            self.recoveries += 1
            self._back_at = time.monotonic()
            return True
        if log:
            self._log_at = now + LOG_EVERY_S
        self._delay = min(self._delay * 2, RETRY_MAX_S)
        self._next_try = time.monotonic() + self._delay
        return False

    def step_failed(self, rids: set[str]) -> list[str]:
        """Charge a failed step to the requests of its plan; returns those
        charged MAX_STEP_FAILURES times (the engine fails them)."""
        find = self.sched.find
        strikes = {rid: (req, n) for rid, (req, n) in self._strikes.items() if find(rid) is req}
        doomed = []
        for rid in sorted(rids):
            req = find(rid)
            if req is None:
                continue
            held, n = strikes.get(rid, (req, 0))
            n = n + 1 if held is req else 1
            strikes[rid] = (req, n)
            if n >= MAX_STEP_FAILURES:
                doomed.append(rid)
                del strikes[rid]
        self._strikes = strikes
        return doomed

    def expired(self) -> bool:
        """Whether the outage has outlasted the timeout (logged once)."""
        if not self._gave_up and time.monotonic() - self._lost_at >= self.timeout_s:
            self._gave_up = True
            logger.error(
                "worker group not back in time: failing its requests with UNAVAILABLE "
                "(new ones too until it returns)",
                recovery_timeout_s=self.timeout_s,
                requests=self.sched.table_sizes()[2],
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
        num_pages = sched.kv_snapshot()[2]
        if info.num_pages != num_pages or info.num_swa_pages or config.hicache_host_pages:
            logger.info(
                "the worker group's KV pool sizes",
                pages=info.num_pages,
                was=num_pages,
                swa_pages=info.num_swa_pages,
                host_pages=info.num_host_pages,
            )
            try:
                sched.resize_pool(info.num_pages, info.num_swa_pages, info.num_host_pages)
            except (
                RuntimeError
            ) as e:  # it lost (or gained) its sliding layers, or lost its host pool
                logger.error("the worker group came back with another KV layout", error=str(e))
                self.group.drop_streams()
                return False
        if config.hicache_storage_pages and not info.num_storage_pages:
            logger.error("the worker group came back without its file tier; not using it")
            self.group.drop_streams()
            return False
        if self.before_open is not None:
            try:
                self.before_open()
            except WorkerError as e:
                if log:
                    logger.info("waiting for the worker group", error=str(e))
                self.group.drop_streams()
                return False
        try:
            self.group.open()
        except WorkerError as e:
            # Refused (a newer scheduler holds the group: this one stays out
            # and its requests end at the timeout) or not answered in time.
            if log or str(e) != self._refused:
                logger.warning("the worker group refused the session", error=str(e))
                self._refused = str(e)
            self.group.drop_streams()
            return False
        sched.note_stored_blocks(self.group.stored_hashes)  # the index went with the loss
        return True
