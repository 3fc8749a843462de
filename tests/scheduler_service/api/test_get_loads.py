"""GetLoads and the KV-event stream's load record, as SGLang's servicer fills
them (api/convert/loads.py): every section asked for, the data-parallel rank
honoured, the queued token-work the gateway's load-aware policies read, and
heartbeats before the first batch only for a subscriber that asks."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api import kv_publisher
from scheduler_service.core.kv.events import BlockStored
from tests.scheduler_service.api.support.api_in_process import api_in_process, until
from tests.scheduler_service.api.support.pipe_core import load, ready

GIB = 1 << 30
BUSY = dict(
    running=3,
    waiting=2,
    used_tokens=256,
    waiting_uncached_tokens=700,
    retracted_waiting=1,
    adapter_slots_used=1,
    adapter_slots_total=4,
    spec_rows=10,
    spec_draft_tokens=40,
    spec_accepted_tokens=25,
)


def with_memory() -> ipc.Ready:
    return dataclasses.replace(
        ready(), weight_bytes=3 * GIB // 2, kv_cache_bytes=GIB // 4, graph_bytes=0
    )


def test_every_section_is_filled_and_core_alone_has_none():
    async def run() -> None:
        async with api_in_process(first_ready=with_memory()) as api:
            api.core.say(ipc.Outputs([], load(waiting_uncached_tokens=9)))
            await until(lambda: api.client.load is not None, "the snapshot")
            (idle,) = (await api.stub.GetLoads(pb.GetLoadsRequest(include=["spec"]))).loads
            assert idle.num_waiting_uncached_tokens == 9
            assert not idle.HasField("speculative")  # as SGLang: once drafts were verified
            api.core.say(ipc.Outputs([], load(**BUSY)))
            await until(lambda: api.client.load.running == 3, "the busy snapshot")
            (s,) = (await api.stub.GetLoads(pb.GetLoadsRequest(include=["all"]))).loads
            assert s.num_waiting_uncached_tokens == 700
            assert (s.memory.weight_gb, s.memory.kv_cache_gb) == (1.5, 0.25)
            assert s.memory.token_capacity == 1024
            assert s.speculative.accept_length == 3.5  # 1 + 25 accepted / 10 rows
            assert s.speculative.accept_rate == 0.625
            assert (s.lora.slots_used, s.lora.slots_total, s.lora.utilization) == (1, 4, 0.25)
            assert s.disaggregation.mode == "null"
            assert (s.queues.waiting, s.queues.retracted) == (2, 1)
            (core,) = (await api.stub.GetLoads(pb.GetLoadsRequest(include=["core"]))).loads
            assert core.num_waiting_uncached_tokens == 700
            for name in ("memory", "speculative", "lora", "disaggregation", "queues"):
                assert not core.HasField(name), name
            (lora,) = (await api.stub.GetLoads(pb.GetLoadsRequest(include=["lora"]))).loads
            assert lora.HasField("lora") and not lora.HasField("memory")

    asyncio.run(run())


def test_dp_rank_zero_is_served_and_another_rank_is_refused_by_name():
    async def run() -> None:
        async with api_in_process() as api:
            reply = await api.stub.GetLoads(pb.GetLoadsRequest(dp_rank=0))
            assert [s.dp_rank for s in reply.loads] == [0] and reply.dp_rank_count == 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "dp_rank 1" in e.value.details()

    asyncio.run(run())


@pytest.mark.parametrize("asked", [True, False])
def test_heartbeats_before_the_first_batch_go_only_to_a_subscriber_that_asks(monkeypatch, asked):
    monkeypatch.setattr(kv_publisher, "HEARTBEAT_S", 0.05)

    async def run() -> None:
        async with api_in_process(first_ready=with_memory()) as api:
            api.core.say(ipc.Outputs([], load(**BUSY)))
            await until(lambda: api.client.load is not None, "the snapshot")
            request = cpb.SubscribeKvEventsRequest(load_records_before_first_batch=asked)
            stream = api.stub.SubscribeKvEvents(request)
            reader = asyncio.ensure_future(stream.read())
            await asyncio.sleep(0.5)  # ten heartbeat periods
            if asked:
                batch = reader.result()
                assert batch.sequence_number == 0 and batch.load.load_only
                assert batch.load.waiting_uncached_tokens == 700
                assert batch.load.lora.slots_total == 4 and batch.load.memory.weight_gb == 1.5
            else:
                assert not reader.done()
                stored = BlockStored([11], None, [1, 2, 3, 4], 4, None)
                while not reader.done():
                    api.core.say(ipc.Outputs([], load(**BUSY), events=[stored]))
                    await asyncio.sleep(0.02)
                batch = reader.result()
                assert batch.events and not batch.load.load_only
                assert batch.load.waiting_uncached_tokens == 700
                beat = await stream.read()  # later heartbeats repeat its sequence
                while not beat.load.load_only:
                    beat = await stream.read()
                assert beat.sequence_number >= batch.sequence_number > 0
            stream.cancel()

    asyncio.run(run())
