"""Graceful drain (api/drain.py with the servicer and readiness, in the order
server.py runs them): new calls end UNAVAILABLE at once, the calls in flight
finish within --drain-timeout, the rest end UNAVAILABLE at the deadline (or
at a second signal) and the core is told to drop them."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from scheduler_service import ipc
from scheduler_service.api.readiness import LIVENESS
from scheduler_service.api.server import SERVICE_NAME
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, tokens

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_calls_that_finish_in_time_complete_and_the_rest_end_unavailable_at_the_deadline():
    async def run() -> None:
        async with api_in_process() as api:
            quick = api.stub.Generate(generate_request("quick", stream=False))
            (sq,) = await api.submitted()
            slow = api.stub.Generate(generate_request("slow", max_new=100))
            (ss,) = await api.submitted()
            api.core.say(tokens((ss.rid, 1)))
            await slow.read()
            started = time.monotonic()
            draining = asyncio.ensure_future(api.shutdown(drain_timeout_s=0.5))
            await asyncio.sleep(0.05)
            # admission stopped, readiness off, liveness on: a drain is no failure
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("late")).read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()
            assert await api.health(SERVICE_NAME) == NOT_SERVING
            assert await api.health(LIVENESS) == SERVING
            api.core.say(finish(sq.rid, 7))
            assert [list(r.complete.output_ids) async for r in quick] == [[7]]
            result = await draining
            assert 0.5 <= time.monotonic() - started < 5.0  # the deadline, not 30 s
            assert (result.in_flight, result.ended) == (2, 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while await slow.read() is not grpc.aio.EOF:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain ended by --drain-timeout 0.5 s" in e.value.details()
            abort = await api.core.receive_kind(ipc.Abort)
            assert abort.rids == [ss.rid]
            rest = await api.core.rest()
            assert not [m for m in rest if isinstance(m, ipc.Submit)]  # "late" never did

    asyncio.run(run())


def test_an_idle_server_drains_at_once():
    async def run() -> None:
        async with api_in_process() as api:
            result = await api.shutdown(drain_timeout_s=30)
            assert (result.in_flight, result.ended) == (0, 0) and result.seconds < 0.5

    asyncio.run(run())


def test_a_second_signal_ends_the_drain_at_once():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("long", max_new=100))
            (s,) = await api.submitted()
            force = asyncio.Event()
            draining = asyncio.ensure_future(api.shutdown(drain_timeout_s=30, force=force))
            await asyncio.sleep(0.05)
            assert not draining.done()
            force.set()
            result = await asyncio.wait_for(draining, 2)
            assert (result.in_flight, result.ended) == (1, 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain ended by a second signal" in e.value.details()
            assert (await api.core.receive_kind(ipc.Abort)).rids == [s.rid]

    asyncio.run(run())
