"""Graceful drain on SIGTERM: stop admitting, let the streams in flight finish
within --drain-timeout, end the rest with a clear UNAVAILABLE.

Admission stops first (the servicer answers new Generate calls UNAVAILABLE,
which a gateway retries on another unit; readiness turns NOT_SERVING so
Kubernetes and the gateway stop sending work here). Liveness stays SERVING:
a drain is not a failure. An idle server drains at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from scheduler_service.api.core_client import CoreClient

logger = structlog.get_logger(__name__)

POLL_S = 0.02


@dataclass(frozen=True)
class DrainResult:
    in_flight: int  # calls in flight when the drain began
    ended: int  # calls still running at the deadline (or the second signal), ended
    seconds: float


async def drain(core: CoreClient, timeout_s: float, force: asyncio.Event) -> DrainResult:
    """Wait (admission already stopped) until no call is in flight, at most
    ``timeout_s`` or until ``force`` is set; then end what is left."""
    start = time.monotonic()
    in_flight = core.active_requests
    logger.info("draining", in_flight=in_flight, drain_timeout_s=timeout_s)
    deadline = start + timeout_s
    while core.active_requests and time.monotonic() < deadline and not force.is_set():
        await asyncio.sleep(POLL_S)
    ended = 0
    if core.active_requests:
        why = "a second signal" if force.is_set() else f"--drain-timeout {timeout_s:g} s"
        ended = core.end_calls(
            f"the server shut down before this request finished (drain ended by {why})"
        )
        await asyncio.sleep(0)  # let the calls see it before the server stops
    result = DrainResult(in_flight, ended, time.monotonic() - start)
    log = logger.warning if ended else logger.info
    log("drained", in_flight=in_flight, ended=ended, seconds=round(result.seconds, 3))
    return result
