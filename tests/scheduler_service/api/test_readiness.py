"""grpc.health.v1 readiness and liveness as the core's news changes them
(api/readiness.py): a lost worker group and a dead core turn readiness
NOT_SERVING and keep liveness SERVING (both repair themselves); only workers
that now serve another model turn liveness NOT_SERVING."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api.readiness import LIVENESS, WORKERS_LOST
from scheduler_service.api.server import SERVICE_NAME
from tests.scheduler_service.api.support.api_in_process import Api, api_in_process, until
from tests.scheduler_service.api.support.pipe_core import load, ready

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _states(api: Api) -> tuple[int, int, int]:
    """(overall readiness, the scheduler service's, liveness)."""
    return (await api.health(""), await api.health(SERVICE_NAME), await api.health(LIVENESS))


async def _until_states(api: Api, want: tuple[int, int, int], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3.0
    while (got := await _states(api)) != want:
        assert loop.time() < deadline, f"{what}: health is {got}, expected {want}"
        await asyncio.sleep(0.01)


def _step(worker_connected: bool) -> ipc.Outputs:
    return ipc.Outputs(deltas=[], load=load(worker_connected=worker_connected))


def test_a_lost_worker_group_turns_readiness_off_and_back_on_with_liveness_on_throughout():
    async def run() -> None:
        async with api_in_process() as api:
            await _until_states(api, (SERVING, SERVING, SERVING), "started")
            api.core.say(_step(worker_connected=False))
            await _until_states(api, (NOT_SERVING, NOT_SERVING, SERVING), "workers lost")
            assert api.readiness.not_ready_reason() == WORKERS_LOST
            # no probe is sent to a core that waits for its workers
            health = await api.stub.HealthCheck(pb.HealthCheckRequest())
            assert not health.healthy and health.message == WORKERS_LOST
            assert await api.core.nothing_sent()
            api.core.say(_step(worker_connected=True))
            await _until_states(api, (SERVING, SERVING, SERVING), "workers back")

    asyncio.run(run())


def test_a_dead_core_turns_readiness_off_until_its_successor_is_ready():
    async def run() -> None:
        async with api_in_process() as api:
            first = api.core
            first.die()
            await _until_states(api, (NOT_SERVING, NOT_SERVING, SERVING), "core dead")
            assert "core process died" in api.readiness.not_ready_reason()
            await until(lambda: len(api.cores) == 2, "a successor")
            api.core.say(ready())
            await _until_states(api, (SERVING, SERVING, SERVING), "successor ready")
            assert api.client.restarts == 1

    asyncio.run(run())


def test_a_core_failing_on_an_internal_error_is_restarted_and_readiness_follows():
    async def run() -> None:
        async with api_in_process() as api:
            api.core.say(ipc.Failed("scheduler integrity check failed after a step", "INTERNAL"))
            await _until_states(api, (NOT_SERVING, NOT_SERVING, SERVING), "core failed")
            api.cores[0].die("exited with status 1")
            await until(lambda: len(api.cores) == 2, "a successor")
            api.core.say(ready())
            await _until_states(api, (SERVING, SERVING, SERVING), "successor ready")

    asyncio.run(run())


def test_workers_serving_another_model_turn_liveness_off():
    async def run() -> None:
        async with api_in_process() as api:
            api.core.die()
            await until(lambda: len(api.cores) == 2, "a successor")
            api.core.say(ready(model="another"))
            await _until_states(api, (NOT_SERVING, NOT_SERVING, NOT_SERVING), "model changed")
            assert "the workers now serve another model" in api.client.stuck

    asyncio.run(run())
