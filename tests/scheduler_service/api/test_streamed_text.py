"""What a streaming Generate call sends and when, and the model's defaults,
as SGLang serves them: a chunk at the first token, then every
stream_interval tokens; nothing while the text may be becoming a stop string
(the core's ``holding``); GetModelInfo's bos, pad and sampling defaults, and
the defaults a request's unset fields take. Driven through the public gRPC
API in-process, the core a PipeCore."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.config import PublicApiConfig
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, load, ready, tokens

READ_S = 2.0


async def _chunk(call) -> list[int]:
    """The next chunk's tokens (a call that sends none in time fails)."""
    response = await asyncio.wait_for(call.read(), READ_S)
    assert response.HasField("chunk"), response
    return list(response.chunk.token_ids)


def _held(rid: str, token: int) -> ipc.Outputs:
    return ipc.Outputs(deltas=[ipc.DeltaOut(rid, [token], holding=True)], load=load())


def test_the_first_token_goes_at_once_then_every_stream_interval_tokens():
    async def run() -> None:
        async with api_in_process() as api:
            req = generate_request("r", max_new=8)
            req.sampling_params.stream_interval = 3
            call = api.stub.Generate(req)
            (s,) = await api.submitted()
            api.core.say(tokens((s.rid, 11)))
            assert await _chunk(call) == [11]  # SGLang: token 1 at once
            for t in (12, 13, 14):
                api.core.say(tokens((s.rid, t)))
            assert await _chunk(call) == [12, 13, 14]  # output 4 = 1 + 3
            for t in (15, 16):
                api.core.say(tokens((s.rid, t)))
            api.core.say(finish(s.rid, 17))  # the finish carries the rest
            assert await _chunk(call) == [15, 16, 17]
            last = await asyncio.wait_for(call.read(), READ_S)
            assert list(last.complete.output_ids) == [15, 16, 17]

    asyncio.run(run())


class _Chunks:
    """Reads a call's responses as they come; ``settled`` waits for quiet."""

    def __init__(self, call) -> None:
        self.got: list[list[int]] = []
        self.task = asyncio.ensure_future(self._read(call))

    async def _read(self, call) -> None:
        async for r in call:
            if r.HasField("chunk"):
                self.got.append(list(r.chunk.token_ids))

    async def settled(self, quiet_s: float = 0.3) -> list[list[int]]:
        while True:
            n = len(self.got)
            await asyncio.sleep(quiet_s)
            if len(self.got) == n:
                return self.got


def test_text_that_may_become_a_stop_string_waits_until_it_cannot():
    async def run() -> None:
        async with api_in_process() as api:
            chunks = _Chunks(api.stub.Generate(generate_request("r", max_new=8)))
            (s,) = await api.submitted()
            api.core.say(tokens((s.rid, 11)))
            assert await chunks.settled() == [[11]]
            api.core.say(_held(s.rid, 12))
            assert await chunks.settled() == [[11]]
            api.core.say(_held(s.rid, 13))
            assert await chunks.settled() == [[11]]
            api.core.say(tokens((s.rid, 14)))  # the text moved on: all three go
            assert await chunks.settled() == [[11], [12, 13, 14]]
            api.core.say(_held(s.rid, 15))
            assert await chunks.settled() == [[11], [12, 13, 14]]
            api.core.say(finish(s.rid, 16, "stop"))  # a finish sends what was held
            await asyncio.wait_for(chunks.task, READ_S)
            assert chunks.got == [[11], [12, 13, 14], [15, 16]]

    asyncio.run(run())


def test_held_tokens_keep_the_stream_interval_rhythm():
    async def run() -> None:
        async with api_in_process() as api:
            req = generate_request("r", max_new=9)
            req.sampling_params.stream_interval = 2
            chunks = _Chunks(api.stub.Generate(req))
            (s,) = await api.submitted()
            api.core.say(_held(s.rid, 11))
            assert await chunks.settled() == []
            api.core.say(tokens((s.rid, 12)))  # released at output 2, due since 1
            assert await chunks.settled() == [[11, 12]]
            api.core.say(tokens((s.rid, 13)))  # output 3 = 1 + 2
            assert await chunks.settled() == [[11, 12], [13]]
            api.core.say(tokens((s.rid, 14)))
            assert await chunks.settled() == [[11, 12], [13]]
            chunks.task.cancel()

    asyncio.run(run())


DECLARED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def _ready_with_defaults(**more) -> ipc.Ready:
    declared = DECLARED | more
    return dataclasses.replace(ready(), bos_token_id=1, pad_token_id=7, sampling_defaults=declared)


def test_model_info_reports_bos_pad_and_the_models_sampling_defaults():
    async def run() -> None:
        async with api_in_process(first_ready=_ready_with_defaults()) as api:
            info = await api.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.bos_token_id, info.pad_token_id, list(info.eos_token_ids)) == (1, 7, [2])
            assert json.loads(info.default_sampling_params_json) == DECLARED
            assert info.preferred_sampling_params == ""  # no operator preferences
        async with api_in_process() as api:  # a model that declares nothing
            info = await api.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.bos_token_id, info.pad_token_id) == (0, 0)  # not the first EOS
            assert info.default_sampling_params_json == ""

    asyncio.run(run())


def test_unset_fields_take_the_models_defaults_and_set_ones_win():
    async def run() -> None:
        first = _ready_with_defaults(max_new_tokens=5)
        async with api_in_process(first_ready=first) as api:
            unset = generate_request("a", stream=False)
            unset.sampling_params.ClearField("max_new_tokens")
            api.stub.Generate(unset)
            (a,) = await api.submitted()
            sp = a.sampling
            assert (sp.top_p, sp.top_k, sp.repetition_penalty) == (0.9, 20, 1.1)
            assert sp.max_new_tokens == 5 and sp.temperature == 0.0  # 0 is greedy, sent
            given = generate_request("b", max_new=3, stream=False)
            given.sampling_params.top_p, given.sampling_params.top_k = 0.5, 4
            given.sampling_params.repetition_penalty = 1.25
            api.stub.Generate(given)
            (b,) = await api.submitted()
            sp = b.sampling
            assert (sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_new_tokens) == (
                0.5,
                4,
                1.25,
                3,
            )
        openai = PublicApiConfig(sampling_defaults="openai")
        async with api_in_process(first_ready=first, api_config=openai) as api:
            info = await api.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.default_sampling_params_json == ""
            unset = generate_request("c", stream=False)
            unset.sampling_params.ClearField("max_new_tokens")
            api.stub.Generate(unset)
            (c,) = await api.submitted()
            sp = c.sampling
            assert (sp.top_p, sp.top_k, sp.repetition_penalty) == (1.0, -1, 1.0)
            assert sp.max_new_tokens == 512 - 3  # until the context is full

    asyncio.run(run())
