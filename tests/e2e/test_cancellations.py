"""1,000 streams cancelled at random points (client-side cancels, the Abort
RPC, and cancels before the first token, many while still queued) leave no
page held and no request state behind, in the API process or the core."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.sim_server import VOCAB, assert_idle_and_clean, flush, simulated_server
from tests.e2e.support.system import greedy, stub

STREAMS = 1000
AT_ONCE = 48  # more than --max-running-requests: many are cancelled while waiting
MODES = ("cancel", "abort", "cancel-before-first", "abort-before-first")


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    # a chunk per token (no chunk budget): the streams are cancelled after
    # a random number of chunks, which paced streams of 0.5 ms steps never reach
    args = ("--max-running-requests", "16", "--max-n", "4", "--stream-chunks-per-s", "0")
    tmp = tmp_path_factory.mktemp("cancel")
    with simulated_server(tmp, num_pages=256, page_size=4, step_ms=0.5, scheduler_args=args) as a:
        yield a


async def one(s: pb_grpc.SglangSchedulerStub, i: int, rng: random.Random) -> tuple[str, str]:
    mode = MODES[i % len(MODES)]
    rid = f"cancel-{i}"
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    if i % 5 == 0:  # shared prefixes: cancelled requests that hit and fill the cache
        prompt = [11] * 24 + prompt
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=greedy(rng.randint(8, 60), ignore_eos=True, n=1 + (i % 7 == 0)),
        stream=True,
    )
    call = s.Generate(req, timeout=60)
    after = 0 if mode.endswith("before-first") else rng.randint(1, 12)
    if after == 0:
        await asyncio.sleep(rng.random() * 0.003)  # on its way, queued, or just admitted
    seen = 0
    try:
        if after == 0:
            await _stop(s, call, rid, mode)
        async for _ in call:
            seen += 1
            if seen == after:
                await _stop(s, call, rid, mode)
    except grpc.aio.AioRpcError as e:
        return mode, e.code().name
    except asyncio.CancelledError:
        return mode, "CANCELLED"
    return mode, (await call.code()).name


async def _stop(s: pb_grpc.SglangSchedulerStub, call, rid: str, mode: str) -> None:
    if mode.startswith("cancel"):
        call.cancel()
    else:
        assert (await s.Abort(pb.AbortRequest(request_id=rid), timeout=10)).success


def test_1000_cancelled_streams_leave_nothing_behind(address):
    rng = random.Random(7)
    gate = asyncio.Semaphore(AT_ONCE)

    async def gated(s, i: int) -> tuple[str, str]:
        async with gate:
            return await one(s, i, rng)

    async def run() -> list[tuple[str, str]]:
        async with grpc.aio.insecure_channel(address) as ch:
            s = pb_grpc.SglangSchedulerStub(ch)
            return await asyncio.gather(*(gated(s, i) for i in range(STREAMS)))

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    outcomes = collections.Counter(results)
    # a cancel is CANCELLED; an aborted stream ends OK (finish reason abort),
    # or OK with all its tokens when the abort came after the last one
    assert {code for _, code in outcomes} <= {"CANCELLED", "OK"}, outcomes
    # (a stream whose tokens came in fewer chunks than the cancel point ends OK)
    assert outcomes[("cancel", "CANCELLED")] > STREAMS // len(MODES) * 0.8, outcomes
    assert outcomes[("cancel-before-first", "CANCELLED")] == STREAMS // len(MODES), outcomes
    s = stub(address)
    snap = assert_idle_and_clean(s, timeout_s=20)
    assert snap.used_tokens == 0
    flush(s)
    assert_idle_and_clean(s)
    (r,) = list(
        s.Generate(
            pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), sampling_params=greedy(5)
            ),
            timeout=10,
        )
    )
    assert r.complete.completion_tokens == 5  # still serving
    print(f"{STREAMS} cancelled streams in {elapsed:.1f}s: {dict(outcomes)}")
