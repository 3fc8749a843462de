"""Sliding-window memory through the real processes: a simulated worker
shaped like a model with sliding-window layers (--simulated-swa-window) tells
the scheduler its sliding pool, every plan carries the sliding pages over
gRPC, and the worker's validation refuses any plan whose sliding pages are
out of range or the null page inside a query's window. Long prompts with
shared prefixes, chunked, in a small sliding pool: every output is the
simulated model's, and prefixes come back from the cache."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.simulated_model import expected_output
from tests.e2e.support.system import greedy, separate

pytestmark = pytest.mark.server

VOCAB = 32000
MAX_NEW = 24
WINDOW = 10  # tokens: 2.5 pages of 4, so windows start inside pages


def prompts() -> list[list[int]]:
    rng = random.Random(32)
    heads = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(30, 60))] for _ in range(3)]
    return [
        heads[i % 3] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 40))]
        for i in range(12)
    ]


async def _run(address: str, ids: list[list[int]]) -> list[pb.GenerateComplete]:
    async def one(s, i: int, prompt: list[int]) -> pb.GenerateComplete:
        req = pb.GenerateRequest(
            request_id=f"swa{i}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=greedy(MAX_NEW, ignore_eos=True),
        )
        (r,) = [r async for r in s.Generate(req, timeout=120)]
        return r.complete

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        first = await asyncio.gather(*(one(s, i, p) for i, p in enumerate(ids[:6])))
        rest = await asyncio.gather(*(one(s, i + 6, p) for i, p in enumerate(ids[6:])))
        return [*first, *rest]


def test_a_sliding_window_worker_gets_valid_sliding_pages_and_outputs_are_right(tmp_path):
    worker = [
        *("--model", "simulated", "--simulated-step-ms", "0.5"),
        *("--simulated-swa-window", str(WINDOW), "--swa-full-tokens-ratio", "0.3"),
        *("--num-pages", "200", "--page-size", "4", "--log-level", "warning"),
    ]
    scheduler = ["--chunked-prefill-size", "16", "--log-level", "warning"]
    ids = prompts()
    with separate(tmp_path, worker, scheduler, env={"RADIXSERVE_CHECK_INTEGRITY": "1"}) as addr:
        done = asyncio.run(_run(addr, ids))
    for prompt, c in zip(ids, done, strict=True):
        assert list(c.output_ids) == expected_output(prompt, MAX_NEW, VOCAB)
    # The second half shares the first half's prefixes: read back from the
    # cache, cut back to lengths whose window's sliding pages are held.
    assert sum(c.cached_tokens for c in done[6:]) > 0
