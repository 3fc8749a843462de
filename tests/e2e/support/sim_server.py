"""A simulated-worker server with a small page pool, and the checks that it
holds nothing once idle (shared by the limits, fuzz and cancellation tests)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.system import separate

VOCAB = 32000


@contextmanager
def simulated_server(
    tmp: Path,
    num_pages: int = 64,
    page_size: int = 4,
    step_ms: float = 0.5,
    scheduler_args: tuple[str, ...] = (),
    check_integrity: bool = True,
) -> Iterator[str]:
    """Context length = num_pages * page_size (the pool caps it), so small
    pools make the context limits and retraction easy to reach."""
    worker = [
        "--model",
        "simulated",
        "--simulated-step-ms",
        str(step_ms),
        "--num-pages",
        str(num_pages),
        "--page-size",
        str(page_size),
        "--log-level",
        "warning",
    ]
    env = {"RADIXSERVE_CHECK_INTEGRITY": "1" if check_integrity else None}
    with separate(tmp, worker, ["--log-level", "warning", *scheduler_args], env=env) as addr:
        yield addr


@dataclass
class Snapshot:
    running: int
    waiting: int
    used_tokens: int
    api_requests: int  # samples the API process routes outputs for
    queued: int  # samples the API process counts against --max-queued-requests
    core_requests: int  # requests the core holds any state for

    @property
    def idle(self) -> bool:
        return not (
            self.running
            or self.waiting
            or self.used_tokens
            or self.api_requests
            or self.queued
            or self.core_requests
        )


def snapshot(s: pb_grpc.SglangSchedulerStub) -> Snapshot:
    load = s.GetLoads(pb.GetLoadsRequest(include=["core"])).loads[0]
    info = s.GetServerInfo(pb.GetServerInfoRequest())
    sched = info.scheduler_info
    return Snapshot(
        load.num_running_reqs,
        load.num_waiting_reqs,
        load.num_used_tokens,
        info.active_requests,
        int(sched["queued_requests"]),
        int(sched["core_requests"]),
    )


def assert_idle_and_clean(s: pb_grpc.SglangSchedulerStub, timeout_s: float = 10.0) -> Snapshot:
    """The server answers, holds no request state and no page beyond the cache.

    The core sends a load snapshot only with a step's outputs, so a health
    check (a 1-token generation) refreshes it before it is read."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = s.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert health.healthy, health.message
        snap = snapshot(s)
        if snap.idle:
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle and clean: {snap}")
        time.sleep(0.02)


def flush(s: pb_grpc.SglangSchedulerStub) -> cpb.FlushCacheResponse:
    result = s.FlushCache(cpb.FlushCacheRequest(timeout_s=5.0), timeout=10)
    assert result.success, result.message
    return result
