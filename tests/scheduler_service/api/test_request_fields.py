"""Public fields the API process answers itself: unknown custom_params keys and
a client timestamp refused by name, the prefill-only scoring row in the
response, weight_version and the grammar backend reported."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.core.plan import TokenLogprobs
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import load, ready


def _custom(**values) -> Struct:
    s = Struct()
    s.update(values)
    return s


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda r: r.sampling_params.custom_params.CopyFrom(_custom(temp=1)), "['temp']"),
        (lambda r: r.timestamp.CopyFrom(Timestamp(seconds=5)), "timestamp"),
    ],
)
def test_fields_radixserve_would_drop_are_refused_by_name(change, needle):
    async def run() -> None:
        async with api_in_process() as api:
            req = generate_request("r")
            change(req)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in api.stub.Generate(req, timeout=5):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in e.value.details()
            assert await api.core.nothing_sent()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [True, False])
def test_prefill_only_scoring_returns_its_next_token_row(stream):
    async def run() -> None:
        async with api_in_process() as api:
            req = generate_request("s", max_new=0, stream=stream)
            req.return_logprob = True
            req.token_ids_logprob.extend([3, 5])
            call = api.stub.Generate(req)
            (sub,) = await api.submitted()
            row = TokenLogprobs(logprob=-0.5, ids=[3, 5], ids_logprobs=[-1.25, -2.5])
            api.core.say(ipc.Outputs([ipc.DeltaOut(sub.rid, [], next_token_logprobs=row)], load()))
            api.core.say(
                ipc.Outputs([ipc.DeltaOut(sub.rid, [], finish=ipc.Finish("length"))], load())
            )
            replies = [r async for r in call]
            done = replies[-1].complete
            assert list(done.output_ids) == [] and done.finish_reason == "length"
            (got,) = done.output_logprobs.token_ids_logprobs
            assert (list(got.token_ids), list(got.values)) == ([3, 5], [-1.25, -2.5])
            assert list(done.output_logprobs.token_logprobs) == []  # no token, no logprob
            if stream:
                chunks = [r.chunk for r in replies if r.HasField("chunk")]
                rows = [x for c in chunks for x in c.output_logprobs.token_ids_logprobs]
                assert len(rows) == 1 and list(rows[0].values) == [-1.25, -2.5]

    asyncio.run(run())


def test_weight_version_and_grammar_backend_are_reported():
    async def run() -> None:
        first = dataclasses.replace(ready(), grammar_backend="xgrammar")
        async with api_in_process(first_ready=first) as api:
            info = await api.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.weight_version == "default"
            server = await api.stub.GetServerInfo(pb.GetServerInfoRequest())
            assert server.server_args["grammar_backend"] == "xgrammar"
            assert server.server_args["weight_version"] == "default"

    asyncio.run(run())
