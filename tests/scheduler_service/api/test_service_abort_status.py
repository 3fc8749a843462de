"""An abort the service decided (the core's Finish with a code: out of
memory, an adapter lost with the workers) ends the Generate call with that
status and the core's message, as SGLang's servicer ends a stream its
scheduler aborted with a status; an abort the client asked for still ends
with a GenerateComplete, finish_reason "abort". Driven through the public
gRPC API in-process, the core a PipeCore."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_service import ipc
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, load, tokens

OOM = "out of memory: the KV cache cannot hold this request even after retracting all others"


def _aborted(rid: str, message: str, code: str) -> ipc.Outputs:
    finish = ipc.Finish("abort", message=message, code=code)
    return ipc.Outputs(deltas=[ipc.DeltaOut(rid, [], finish=finish)], load=load())


def test_a_streamed_call_the_core_aborts_ends_with_its_status_and_message():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("r", max_new=8))
            (s,) = await api.submitted()
            api.core.say(tokens((s.rid, 5)))
            assert list((await call.read()).chunk.token_ids) == [5]
            api.core.say(_aborted(s.rid, OOM, "RESOURCE_EXHAUSTED"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == OOM
            assert api.metrics.errors["RESOURCE_EXHAUSTED"] == 1
            assert api.metrics.finished["abort"] == 1
            assert api.client.active_requests == 0 and api.client.queued == 0

    asyncio.run(run())


def test_one_sample_aborted_by_the_core_ends_the_call_and_its_siblings():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("n2", n=2, stream=False))
            first, second = await api.submitted()
            lost = "LoRA adapter 'chat' could not be loaded again after a worker loss"
            api.core.say(_aborted(second.rid, lost, "UNAVAILABLE"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, lost)
            abort = await api.core.receive_kind(ipc.Abort)
            assert sorted(abort.rids) == sorted([first.rid, second.rid])

    asyncio.run(run())


def test_an_abort_the_client_asked_for_still_ends_with_a_completion():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("r", stream=False))
            (s,) = await api.submitted()
            api.core.say(finish(s.rid, 4, "abort"))
            (r,) = [r async for r in call]
            assert r.complete.finish_reason == "abort" and list(r.complete.output_ids) == [4]
            assert not any(api.metrics.errors.values())

    asyncio.run(run())
