"""What grpc.health.v1 reports: readiness and liveness, kept apart.

Readiness (service ``""`` and ``sglang.grpc.scheduler.SglangScheduler``):
SERVING only while new work can be served here: NOT_SERVING while the worker
group is lost (requests would only wait for it), while draining for shutdown,
and while the core process is down (it died and is being restarted:
core_supervisor.py). Kubernetes' readiness probe and the gateway then send
new work to other units.

Liveness (service ``liveness``): SERVING while the process can still serve
again by itself, so a worker outage, which recovery repairs, and a dead
core, which the supervisor restarts, keep it SERVING (a restart of the pod
would only lose the requests waiting); NOT_SERVING only while the workers
serve another model than the one this process announced, which only a
restart of this process repairs. An API process whose event loop is stuck
does not answer the probe at all, which the probe counts as a failure.

Both are recomputed whenever the core's load snapshot arrives (it carries
``worker_connected``), whenever the core goes down or comes back, and at
least every ``REFRESH_S``.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from scheduler_service.api.core_client import CoreClient

logger = structlog.get_logger(__name__)

LIVENESS = "liveness"
WORKERS_LOST = "the worker group is lost; waiting for it to come back"
REFRESH_S = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    def __init__(
        self, health: health_aio.HealthServicer, core: CoreClient, services: tuple[str, ...]
    ) -> None:
        self.health = health
        self.core = core
        self.services = services  # the readiness names
        self.draining = False
        self._reported: tuple[bool, bool] | None = None  # (ready, live) last set
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._connected = True  # as of the last load snapshot
        self._unsubscribe = core.on_load(self._on_load)
        core.on_change(self._wake.set)

    def _on_load(self, load) -> None:
        """Every step's snapshot comes here: wake the updater only on a change."""
        if load.worker_connected != self._connected:
            self._connected = load.worker_connected
            self._wake.set()

    def not_ready_reason(self) -> str | None:
        """Why new work should go elsewhere now; None when ready."""
        core = self.core
        if core.failed:
            return core.failed
        if self.draining:
            return "draining for shutdown"
        if core.load is not None and not core.load.worker_connected:
            return WORKERS_LOST
        return None

    async def start(self) -> None:
        await self._update()
        self._task = asyncio.create_task(self._run(), name="readiness")

    async def drain(self) -> None:
        """Shutdown begins: readiness NOT_SERVING from now on, liveness unchanged."""
        self.draining = True
        await self._update()

    async def stop(self) -> None:
        """Everything NOT_SERVING (the server is going away)."""
        self._unsubscribe()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.health.enter_graceful_shutdown()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REFRESH_S)
            self._wake.clear()
            await self._update()

    async def _update(self) -> None:
        reason = self.not_ready_reason()
        state = (reason is None, not self.core.stuck)
        if state == self._reported:
            return
        self._reported = state
        ready, live = state
        for name in self.services:
            await self.health.set(name, SERVING if ready else NOT_SERVING)
        await self.health.set(LIVENESS, SERVING if live else NOT_SERVING)
        if ready:
            logger.info("ready: readiness SERVING")
        else:
            logger.warning(
                "not ready: readiness NOT_SERVING", reason=reason, live=live, stuck=self.core.stuck
            )
