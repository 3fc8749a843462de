"""The API process routes the core's outputs to the Generate calls they
belong to, by internal request id (``public#N``, N unique in the process):
calls that reuse a public id after a cancel never see each other's tokens.
Driven through the public gRPC API in-process, the core a PipeCore."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api import servicer as servicer_module
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, tokens


def _complete(responses: list[pb.GenerateResponse]) -> dict[int, pb.GenerateComplete]:
    return {r.complete.index: r.complete for r in responses if r.HasField("complete")}


def test_outputs_reach_the_call_whose_internal_rid_they_carry():
    async def run() -> None:
        async with api_in_process() as api:
            a = api.stub.Generate(generate_request("a", stream=False))
            (sa,) = await api.submitted()
            b = api.stub.Generate(generate_request("b", stream=False))
            (sb,) = await api.submitted()
            assert (sa.rid, sb.rid) == ("a#1", "b#2")
            assert sa.prompt_ids == [1, 2, 3] and sa.waits_for is None
            # one step for both, interleaved, and a rid no call holds (ignored)
            api.core.say(tokens((sb.rid, 11), (sa.rid, 21), ("gone#7", 99)))
            api.core.say(tokens((sa.rid, 22), (sb.rid, 12)))
            api.core.say(finish(sb.rid, 13))
            api.core.say(finish(sa.rid, 23, "stop"))
            (ra,), (rb,) = [r async for r in a], [r async for r in b]
            assert ra.request_id == "a" and rb.request_id == "b"  # public ids, not #N
            assert list(ra.complete.output_ids) == [21, 22, 23]
            assert ra.complete.finish_reason == "stop"
            assert list(rb.complete.output_ids) == [11, 12, 13]
            assert rb.complete.finish_reason == "length"
            assert api.client.active_requests == 0 and api.client.queued == 0

    asyncio.run(run())


def test_n_samples_get_one_call_number_and_siblings_wait_for_the_first_internal_rid():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("x", n=3, stream=False))
            samples = await api.submitted()
            assert [s.rid for s in samples] == ["x-0#1", "x-1#1", "x-2#1"]
            # rewritten too: a public id here would name no request in the core
            assert [s.waits_for for s in samples] == [None, "x-0#1", "x-0#1"]
            for i, s in enumerate(samples):
                api.core.say(finish(s.rid, 10 + i))
            by_index = _complete([r async for r in call])
            assert {i: list(c.output_ids) for i, c in by_index.items()} == {
                0: [10],
                1: [11],
                2: [12],
            }

    asyncio.run(run())


def test_a_cancelled_id_is_taken_again_at_once_and_the_old_calls_late_tokens_stay_away():
    async def run() -> None:
        async with api_in_process() as api:
            old = api.stub.Generate(generate_request("r", max_new=8))
            (s1,) = await api.submitted()
            api.core.say(tokens((s1.rid, 5)))
            first = await old.read()
            assert list(first.chunk.token_ids) == [5]
            old.cancel()
            abort = await api.core.receive_kind(ipc.Abort)
            assert abort.rids == [s1.rid]
            new = api.stub.Generate(generate_request("r", max_new=2))
            (s2,) = await api.submitted()
            assert s2.rid == "r#2"
            # the old request's last words arrive after the new call began
            api.core.say(tokens((s1.rid, 6), (s2.rid, 7)))
            api.core.say(finish(s1.rid, 0, "abort"))
            api.core.say(finish(s2.rid, 8))
            got = [t for r in [r async for r in new] for t in r.chunk.token_ids]
            assert got == [7, 8]
            assert api.client.active_requests == 0

    asyncio.run(run())


def test_a_second_live_call_with_the_same_id_is_refused(monkeypatch):
    monkeypatch.setattr(servicer_module, "RID_REUSE_GRACE_S", 0.05)

    async def run() -> None:
        async with api_in_process() as api:
            live = api.stub.Generate(generate_request("dup", stream=False))
            (s,) = await api.submitted()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.stub.Generate(generate_request("dup")).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request id 'dup' is already in use" in e.value.details()
            assert await api.core.nothing_sent()  # the refused call reached no core
            api.core.say(finish(s.rid, 1))
            assert [list(r.complete.output_ids) async for r in live] == [[1]]

    asyncio.run(run())


def test_abort_by_public_id_reaches_the_core_as_internal_rids_and_frees_the_id():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("job", n=2, max_new=8))
            samples = await api.submitted()
            reply = await api.stub.Abort(pb.AbortRequest(request_id="job", reason="user"))
            assert reply.success
            abort = await api.core.receive_kind(ipc.Abort)
            assert sorted(abort.rids) == ["job-0#1", "job-1#1"] and abort.reason == "user"
            # the id is free at once, while the aborted call still ends
            again = api.stub.Generate(generate_request("job", n=2, max_new=1, stream=False))
            assert [s.rid for s in await api.submitted()] == ["job-0#2", "job-1#2"]
            for s in samples:
                api.core.say(finish(s.rid, 0, "abort"))
            ended = _complete([r async for r in call])
            assert {c.finish_reason for c in ended.values()} == {"abort"}
            again.cancel()

    asyncio.run(run())


def test_a_sample_the_core_rejects_ends_its_call_invalid_argument_and_aborts_its_siblings():
    async def run() -> None:
        async with api_in_process() as api:
            call = api.stub.Generate(generate_request("bad", n=2))
            first, second = await api.submitted()
            api.core.say(ipc.Rejected(second.rid, "the prompt does not fit in the KV pool"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "the prompt does not fit in the KV pool"
            abort = await api.core.receive_kind(ipc.Abort)
            assert sorted(abort.rids) == [first.rid, second.rid]
            assert api.client.queued == 0  # nothing left counting against the bound

    asyncio.run(run())
