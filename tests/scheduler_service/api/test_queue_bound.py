"""--max-queued-requests bounds the samples that wait for their first token,
counted in the API process (exact: no snapshot from the core lags behind);
a sample leaves the count with its first output, its rejection or its
call's end; health probes are never refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.scheduler_service.api.support.api_in_process import (
    api_in_process,
    generate_request,
    until,
)
from tests.scheduler_service.api.support.pipe_core import finish, tokens


async def _refused(api, rid: str, n: int = 1) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await api.stub.Generate(generate_request(rid, n=n)).read()
    return e.value


def test_past_the_bound_calls_are_refused_until_a_queued_sample_gets_its_first_token():
    async def run() -> None:
        async with api_in_process(max_queued_requests=2) as api:
            a = api.stub.Generate(generate_request("a", max_new=4))
            (sa,) = await api.submitted()
            b = api.stub.Generate(generate_request("b", max_new=4))
            await api.submitted()
            assert api.client.queued == 2
            e = await _refused(api, "c")
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 requests are queued, the limit (--max-queued-requests) is 2" in e.details()
            assert api.metrics.errors["RESOURCE_EXHAUSTED"] == 1
            api.core.say(tokens((sa.rid, 1)))  # a started: it no longer counts
            await a.read()
            assert api.client.queued == 1
            c = api.stub.Generate(generate_request("c", max_new=4))
            (sc,) = await api.submitted()
            assert sc.rid.startswith("c#")
            a.cancel(), b.cancel(), c.cancel()
            await until(lambda: api.client.queued == 0, "the cancelled calls to be forgotten")

    asyncio.run(run())


def test_a_call_of_n_samples_needs_room_for_all_of_them():
    async def run() -> None:
        async with api_in_process(max_queued_requests=3) as api:
            a = api.stub.Generate(generate_request("a"))
            await api.submitted()
            e = await _refused(api, "wide", n=3)
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await api.core.nothing_sent()
            two = api.stub.Generate(generate_request("two", n=2))
            assert len(await api.submitted()) == 2
            assert api.client.queued == 3
            a.cancel(), two.cancel()

    asyncio.run(run())


def test_a_finished_call_frees_its_place_and_a_full_queue_still_answers_health_checks():
    async def run() -> None:
        async with api_in_process(max_queued_requests=1) as api:
            a = api.stub.Generate(generate_request("a", stream=False))
            (sa,) = await api.submitted()
            check = asyncio.ensure_future(api.stub.HealthCheck(pb.HealthCheckRequest()))
            (probe,) = await api.submitted()  # the probe skips the bound
            assert probe.rid.startswith("HEALTH_CHECK_")
            api.core.say(tokens((probe.rid, 1)))
            assert (await check).healthy
            assert (await api.health()) == health_pb2.HealthCheckResponse.SERVING
            api.core.say(finish(sa.rid, 9))
            assert [list(r.complete.output_ids) async for r in a] == [[9]]
            assert api.client.queued == 0
            b = api.stub.Generate(generate_request("b"))
            assert len(await api.submitted()) == 1
            b.cancel()

    asyncio.run(run())
