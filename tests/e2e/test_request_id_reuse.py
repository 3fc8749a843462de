"""A request id is free again as soon as its call is cancelled or aborted: a
client that cancels request X and at once sends a new X gets the new call
served in full, and the old call's clean-up never touches it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.sim_server import assert_idle_and_clean, simulated_server
from tests.e2e.support.system import greedy, stub

ROUNDS = 40


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rid-reuse")
    with simulated_server(tmp, num_pages=256, page_size=4, step_ms=1.0) as a:
        yield a


def _request(rid: str, max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8, 9]),
        sampling_params=greedy(max_new, ignore_eos=True),
        stream=True,
    )


async def _cancel_and_resubmit(s: pb_grpc.SglangSchedulerStub, i: int) -> tuple[str, int, str]:
    rid = f"reuse-{i % 3}"  # few ids, reused round after round
    old = s.Generate(_request(rid, 500), timeout=30)
    got = 0
    async for _ in old:
        got += 1
        if got == 1 + i % 3:
            break
    if i % 2:
        old.cancel()
    else:
        assert (await s.Abort(pb.AbortRequest(request_id=rid), timeout=10)).success
    # at once: the same id again
    new = s.Generate(_request(rid, 6), timeout=30)
    tokens, finish = 0, ""
    try:
        async for r in new:
            tokens += len(r.chunk.token_ids)
            if r.HasField("complete"):
                finish = r.complete.finish_reason
    except grpc.aio.AioRpcError as e:
        return rid, tokens, f"{e.code().name}: {e.details()}"
    if not i % 2:  # the aborted old call ends on its own (finish reason abort)
        async for _ in old:
            pass
    return rid, tokens, finish


def test_cancel_then_resubmit_same_id_is_served(address):
    async def run() -> list[tuple[str, int, str]]:
        async with grpc.aio.insecure_channel(address) as ch:
            s = pb_grpc.SglangSchedulerStub(ch)
            out = []
            for i in range(ROUNDS):
                out.append(await _cancel_and_resubmit(s, i))
            return out

    results = asyncio.run(run())
    bad = [r for r in results if r[1:] != (6, "length")]
    assert not bad, bad
    assert_idle_and_clean(stub(address))


def test_a_live_duplicate_id_is_still_refused(address):
    async def run() -> str:
        async with grpc.aio.insecure_channel(address) as ch:
            s = pb_grpc.SglangSchedulerStub(ch)
            live = s.Generate(_request("dup", 1000), timeout=30)
            await live.read()  # running
            try:
                async for _ in s.Generate(_request("dup", 4), timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
            finally:
                live.cancel()
            return "served"

    assert asyncio.run(run()) == "INVALID_ARGUMENT: request id 'dup' is already in use"
    assert_idle_and_clean(stub(address))
