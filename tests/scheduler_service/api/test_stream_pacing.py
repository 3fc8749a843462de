"""--stream-chunks-per-s: the streams in flight share a budget of chunks per
second; a paced stream's tokens gather into its next chunk, its first token
and its end go at once; 0 sends a chunk per token. Driven through the public
gRPC API in-process, the core a PipeCore; the inbox and the shared chunk
grid on their own."""

from __future__ import annotations

import asyncio
import math

from scheduler_service import ipc
from scheduler_service.api.inbox import Inbox
from scheduler_service.api.servicer import chunk_deadline
from scheduler_service.config import PublicApiConfig
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, tokens

READ_S = 2.0
GAP_S = 0.02  # between the core's steps: a reader that keeps up sees each alone


async def _stream(api, rid: str, *, n_tokens: int) -> tuple[list[list[int]], float]:
    """Stream ``n_tokens`` tokens one step apart, then a finish; the chunks'
    tokens as the client got them, and how long the finish took to arrive."""
    call = api.stub.Generate(generate_request(rid, max_new=n_tokens + 1))
    (s,) = await api.submitted()
    got: list[list[int]] = []

    async def read() -> None:
        async for r in call:
            if r.HasField("chunk"):
                got.append(list(r.chunk.token_ids))

    reader = asyncio.ensure_future(read())
    for t in range(10, 10 + n_tokens):
        api.core.say(tokens((s.rid, t)))
        await asyncio.sleep(GAP_S)
    sent = asyncio.get_running_loop().time()
    api.core.say(finish(s.rid, 99))
    await asyncio.wait_for(reader, READ_S)
    return got, asyncio.get_running_loop().time() - sent


def test_a_paced_stream_gathers_its_tokens_and_sends_first_and_last_at_once():
    async def run() -> None:
        # one stream, 4 chunks/s: a chunk every 256 ms (the grid's power of two)
        async with api_in_process(api_config=PublicApiConfig(stream_chunks_per_s=4)) as api:
            got, finish_s = await _stream(api, "r", n_tokens=10)
        assert got[0] == [10]  # the first token at once
        assert [t for c in got for t in c] == [*range(10, 20), 99]  # all, in order
        # 10 steps 20 ms apart span at most one 256 ms grid point: the first
        # chunk, at most two more, the last one (not one chunk per token)
        assert len(got) <= 4, got
        assert finish_s < 0.2  # the end does not wait for the grid

    asyncio.run(run())


def test_without_a_budget_every_token_is_a_chunk():
    async def run() -> None:
        async with api_in_process(api_config=PublicApiConfig(stream_chunks_per_s=0)) as api:
            got, _ = await _stream(api, "r", n_tokens=5)
        assert got == [[10], [11], [12], [13], [14], [99]]

    asyncio.run(run())


def test_the_end_of_a_paced_stream_does_not_wait_for_its_turn():
    async def run() -> None:
        # one stream, a chunk per 1000 s: its next grid point is, but for a
        # chance of 1 in 15,000, long past the test's end
        config = PublicApiConfig(stream_chunks_per_s=0.001)
        async with api_in_process(api_config=config) as api:
            got, finish_s = await _stream(api, "r", n_tokens=3)
        assert got == [[10], [11, 12, 99]]
        assert finish_s < 0.5

    asyncio.run(run())


def test_news_does_not_wake_a_paced_reader_and_an_end_does():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        start = loop.time()
        taking = asyncio.ensure_future(inbox.take(start + 0.3))
        await asyncio.sleep(0.01)
        inbox.put_news("r#1", 5, 0)
        assert await taking == [("r#1", 5, 0)]
        assert loop.time() - start >= 0.29  # it waited for its time

        start = loop.time()
        taking = asyncio.ensure_future(inbox.take(math.inf))  # only an end wakes it
        inbox.put_news("r#1", 6, 0)
        await asyncio.sleep(0.05)
        assert not taking.done()
        end = ipc.DeltaOut("r#1", [7], finish=ipc.Finish("length"))
        inbox.put_nowait(end)
        assert await asyncio.wait_for(taking, 0.5) == [("r#1", 6, 0), end]

        inbox.put_news("r#1", 8, 0)  # unpaced: at once
        assert await asyncio.wait_for(inbox.take(), 0.5) == [("r#1", 8, 0)]

    asyncio.run(run())


def test_the_paced_streams_share_one_grid():
    # 256 streams at 2000 chunks/s: 128 ms apart, on multiples of 128 ms
    assert math.isclose(chunk_deadline(1.0005, 0.128), 1.024)
    assert math.isclose(chunk_deadline(1.0235, 0.128), 1.024)
    # 100 ms rounds up to the same grid, so streams paced a little apart still meet
    assert math.isclose(chunk_deadline(1.0005, 0.1), 1.024)
    # a few streams: a 1 ms grid at least
    assert math.isclose(chunk_deadline(1.0005, 0.0001), 1.001)
