"""With --enable-priority-scheduling a full queue (--max-queued-requests)
makes room for a call of higher priority, as SGLang's scheduler does
(_abort_on_queued_limit): the least preferred waiting call (lowest priority,
the newest among equals) ends RESOURCE_EXHAUSTED with why, and the core is
told to drop it; a newcomer of the same or lower priority is refused as
without priority scheduling, and nobody is evicted unless that makes room.
Driven through the public gRPC API in-process, the core a PipeCore."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.core import SchedulerConfig
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, tokens

PRIORITY = SchedulerConfig(enable_priority_scheduling=True)
EVICTED = "evicted from the full queue by a request of higher priority"


async def _ended(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    return e.value


def test_a_higher_priority_call_evicts_the_lowest_priority_waiting_call():
    async def run() -> None:
        async with api_in_process(max_queued_requests=2, scheduler=PRIORITY) as api:
            low = api.stub.Generate(generate_request("low", priority=1))
            (s_low,) = await api.submitted()
            mid = api.stub.Generate(generate_request("mid", priority=5, stream=False))
            (s_mid,) = await api.submitted()
            high = api.stub.Generate(generate_request("high", priority=9, stream=False))
            abort = await api.core.receive_kind(ipc.Abort)
            assert abort.rids == [s_low.rid] and EVICTED in abort.reason
            (s_high,) = await api.submitted()  # the core drops "low" before it sees "high"
            e = await _ended(low)
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.details() == (
                f"{EVICTED} (the limit (--max-queued-requests) is 2); retry later"
            )
            assert api.metrics.errors["RESOURCE_EXHAUSTED"] == 1
            assert api.client.queued == 2
            api.core.say(finish(s_mid.rid, 7))
            api.core.say(finish(s_high.rid, 8))
            assert [list(r.complete.output_ids) async for r in mid] == [[7]]
            assert [list(r.complete.output_ids) async for r in high] == [[8]]
            assert api.client.queued == 0 and api.client.active_requests == 0

    asyncio.run(run())


def test_a_newcomer_of_the_same_or_lower_priority_is_refused_and_nobody_is_evicted():
    async def run() -> None:
        async with api_in_process(max_queued_requests=2, scheduler=PRIORITY) as api:
            calls = [api.stub.Generate(generate_request(r, priority=5)) for r in ("a", "b")]
            for _ in calls:
                await api.submitted()
            for rid, priority in (("same", 5), ("lower", 4)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await api.stub.Generate(generate_request(rid, priority=priority)).read()
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "2 requests are queued, the limit (--max-queued-requests) is 2" in (
                    e.value.details()
                )
            assert await api.core.nothing_sent()
            assert api.client.queued == 2
            for c in calls:
                c.cancel()

    asyncio.run(run())


def test_the_newest_of_the_least_preferred_goes_first_and_only_if_that_makes_room():
    async def run() -> None:
        async with api_in_process(max_queued_requests=3, scheduler=PRIORITY) as api:
            a = api.stub.Generate(generate_request("a", priority=1))
            (s_a,) = await api.submitted()
            b = api.stub.Generate(generate_request("b", priority=1))
            (s_b,) = await api.submitted()
            c = api.stub.Generate(generate_request("c", priority=4))
            await api.submitted()
            x = api.stub.Generate(generate_request("x", priority=2))
            assert (await api.core.receive_kind(ipc.Abort)).rids == [s_b.rid]
            (s_x,) = await api.submitted()
            assert (await _ended(b)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # three places for priority 3: only "a" and "x" are below it
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("wide", n=3, priority=3)).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert EVICTED not in e.value.details()
            # "b"'s call, ended, repeats its abort; nothing else reached the core
            assert [(type(m), m.rids) for m in await api.core.rest()] == [(ipc.Abort, [s_b.rid])]
            # two places: "x" (priority 2) and then "a" (1) give theirs up
            two = api.stub.Generate(generate_request("two", n=2, priority=3))
            abort_a = await api.core.receive_kind(ipc.Abort)
            abort_x = await api.core.receive_kind(ipc.Abort)
            assert (abort_a.rids, abort_x.rids) == ([s_a.rid], [s_x.rid])
            assert len(await api.submitted()) == 2
            for ended in (a, x):
                assert (await _ended(ended)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert api.client.queued == 3
            c.cancel(), two.cancel()

    asyncio.run(run())


def test_low_values_first_reverses_who_is_evicted():
    config = SchedulerConfig(
        enable_priority_scheduling=True, schedule_low_priority_values_first=True
    )

    async def run() -> None:
        async with api_in_process(max_queued_requests=1, scheduler=config) as api:
            first = api.stub.Generate(generate_request("first", priority=5))
            (s_first,) = await api.submitted()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("nine", priority=9)).read()
            assert EVICTED not in e.value.details()
            urgent = api.stub.Generate(generate_request("urgent", priority=0, stream=False))
            assert (await api.core.receive_kind(ipc.Abort)).rids == [s_first.rid]
            (s_urgent,) = await api.submitted()
            assert (await _ended(first)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            api.core.say(finish(s_urgent.rid, 3))
            assert [list(r.complete.output_ids) async for r in urgent] == [[3]]

    asyncio.run(run())


def test_started_calls_health_probes_and_servers_without_priority_scheduling_evict_nobody():
    async def run() -> None:
        async with api_in_process(max_queued_requests=1, scheduler=PRIORITY) as api:
            started = api.stub.Generate(generate_request("started", priority=0, max_new=8))
            (s_started,) = await api.submitted()
            api.core.say(tokens((s_started.rid, 1)))  # it has its first token: not queued
            await started.read()
            check = asyncio.ensure_future(api.stub.HealthCheck(pb.HealthCheckRequest()))
            (probe,) = await api.submitted()  # takes no place, is never evicted
            waiting = api.stub.Generate(generate_request("waiting", priority=10))
            await api.submitted()
            assert api.client.queued == 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("ten", priority=10)).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # "started" (0) has its token and "waiting" is not lower than 10
            assert EVICTED not in e.value.details()
            assert await api.core.nothing_sent()
            api.core.say(tokens((probe.rid, 1)))
            assert (await check).healthy
            started.cancel(), waiting.cancel()
        async with api_in_process(max_queued_requests=1) as api:
            low = api.stub.Generate(generate_request("low", priority=0))
            await api.submitted()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("high", priority=100)).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert EVICTED not in e.value.details()
            assert await api.core.nothing_sent()
            low.cancel()

    asyncio.run(run())
