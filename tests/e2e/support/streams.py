"""Many streamed Generate calls at once, and a wait for their progress (the
worker-loss, restart and shutdown tests disturb the service mid-stream)."""

from __future__ import annotations

import asyncio
import time

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc


async def run_streams(address: str, reqs: list[pb.GenerateRequest], on_progress=None) -> list:
    """Each stream's (tokens, finish reason or the gRPC error)."""
    progress = [0] * len(reqs)

    async def one(s, i: int, req: pb.GenerateRequest):
        tokens: list[int] = []
        try:
            async for r in s.Generate(req, timeout=240):
                if r.HasField("chunk"):
                    tokens.extend(r.chunk.token_ids)
                    progress[i] = len(tokens)
                if r.HasField("complete"):
                    return tokens, r.complete.finish_reason
        except grpc.aio.AioRpcError as e:
            return tokens, e
        return tokens, None

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        tasks = [asyncio.create_task(one(s, i, r)) for i, r in enumerate(reqs)]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.gather(*tasks)


async def wait_for_progress(progress: list[int], streams: int, tokens: int = 3) -> None:
    deadline = time.monotonic() + 180
    while sum(p >= tokens for p in progress) < streams:
        assert time.monotonic() < deadline, f"no progress: {progress}"
        await asyncio.sleep(0.02)
