"""The information and admin RPCs answered in the API process from the core's
news (api/admin.py, kv_publisher.py, throughput.py): GetLoads from the
latest load snapshot, FlushCache as a round trip to the core (retried until
idle within its timeout), GetServerInfo's leak counters, and the KV event
stream, which hears the cache is gone when the core dies."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api import throughput
from scheduler_service.core.kv.events import BlockStored
from tests.scheduler_service.api.support.api_in_process import (
    api_in_process,
    generate_request,
    until,
)
from tests.scheduler_service.api.support.pipe_core import load


def test_get_loads_reports_the_latest_snapshot_and_the_generation_rate(monkeypatch):
    clock = type("Clock", (), {"now": 50.0, "monotonic": lambda self: self.now})()
    monkeypatch.setattr(throughput, "time", clock)

    async def run() -> None:
        async with api_in_process() as api:
            api.core.say(ipc.Outputs([], load(running=3, waiting=2, used_tokens=256, gen_tokens=0)))
            await until(lambda: api.client.load is not None, "the first load")
            clock.now += 0.5
            api.core.say(
                ipc.Outputs([], load(running=3, waiting=2, used_tokens=256, gen_tokens=100))
            )
            await until(lambda: api.client.load.gen_tokens == 100, "the second load")
            reply = await api.stub.GetLoads(pb.GetLoadsRequest())
            (s,) = reply.loads
            assert (s.num_running_reqs, s.num_waiting_reqs, s.num_total_reqs) == (3, 2, 5)
            assert s.num_used_tokens == 256 and s.max_total_num_tokens == 256 * 4
            assert s.token_usage == 0.25 and s.utilization == round(3 / 8, 4)
            assert s.gen_throughput == 200.0  # 100 tokens in 0.5 s
            assert reply.aggregate.total_reqs == 5
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.GetLoads(pb.GetLoadsRequest(include=["bogus"]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())


def test_flush_cache_asks_the_core_again_until_it_is_idle_within_the_timeout():
    async def run() -> None:
        async with api_in_process() as api:
            flush = asyncio.ensure_future(api.stub.FlushCache(cpb.FlushCacheRequest(timeout_s=5)))
            first = await api.core.receive_kind(ipc.FlushCache)
            api.core.say(ipc.Flushed(first.token, False, "2 requests are running"))
            second = await api.core.receive_kind(ipc.FlushCache)
            assert second.token != first.token
            api.core.say(ipc.Flushed(second.token, True, ""))
            reply = await flush
            assert reply.success and reply.message == "Cache flushed successfully"
            # timeout 0: the core's refusal is the answer
            now = asyncio.ensure_future(api.stub.FlushCache(cpb.FlushCacheRequest()))
            ask = await api.core.receive_kind(ipc.FlushCache)
            api.core.say(ipc.Flushed(ask.token, False, "1 request is running"))
            reply = await now
            assert not reply.success and reply.message == "1 request is running"

    asyncio.run(run())


def test_server_info_counts_queued_and_active_requests():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("q", n=2))
            await api.submitted()
            api.core.say(ipc.Outputs([], load(tracked=2)))
            await until(lambda: api.client.load is not None, "the snapshot")
            info = await api.stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.active_requests == 2
            assert info.scheduler_info["queued_requests"] == 2
            assert info.scheduler_info["core_requests"] == 2
            call.cancel()

    asyncio.run(run())


def test_kv_events_reach_subscribers_and_a_dead_core_clears_every_block():
    async def run() -> None:
        async with api_in_process() as api:
            stream = api.stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
            # the subscription exists once the first batch arrives; send until it does
            stored = BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None)
            reader = asyncio.ensure_future(stream.read())
            while not reader.done():
                api.core.say(ipc.Outputs([], load(used_tokens=8), events=[stored]))
                await asyncio.sleep(0.02)
            batch = reader.result()
            (event,) = batch.events
            assert [b.block_hash for b in event.stored.blocks] == [11, 12]
            assert [list(b.token_ids) for b in event.stored.blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]]
            assert batch.load.num_used_tokens == 8 and not batch.load.load_only
            api.core.die()

            async def cleared() -> cpb.KvEventBatch:
                while True:  # skip batches still queued from before the death
                    batch = await stream.read()
                    if batch.events and batch.events[0].HasField("cleared"):
                        return batch

            batch = await asyncio.wait_for(cleared(), 5)
            assert batch.load.num_used_tokens == 0 and batch.load.running_requests == 0
            stream.cancel()

    asyncio.run(run())
