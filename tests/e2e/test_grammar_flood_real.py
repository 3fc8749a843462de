"""A flood of hard grammars delays only the requests that carry them (issue
27), on the default model through `radixserve serve`: seven concurrent
Generate calls with distinct JSON schemas nested 400 deep (seconds each to
compile) keep the compile processes busy; a tiny schema sent meanwhile
compiles at once and its output is valid JSON, and a plain 24-token Generate
stays within 2x its quiet latency. The flood's calls are then cancelled
(their compiles are killed) and the tiny schema still compiles: nothing
about it was remembered as a failure."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.tokenizer_bundle import TokenizerBundle
from tests.e2e.support.system import stub
from tests.worker_service.support.grammar_load import TINY_SCHEMA, nested_schema

pytestmark = pytest.mark.slow

FLOOD = 7
DEPTH = 400
PLAIN_TOKENS = 24


@pytest.fixture(scope="module")
def bundle(smollm2_address) -> TokenizerBundle:
    return TokenizerBundle.from_chunks(
        stub(smollm2_address).GetTokenizer(cpb.GetTokenizerRequest())
    )


def request(rid: str, ids: list[int], max_new: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw),
    )


async def timed(s: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest):
    """(seconds, status name, the complete message or the error's details)."""
    t0 = time.perf_counter()
    try:
        out = [r async for r in s.Generate(req, timeout=120)]
    except grpc.aio.AioRpcError as e:
        return time.perf_counter() - t0, e.code().name, e.details()
    return time.perf_counter() - t0, "OK", out[-1].complete


async def plain_latencies(s, ids: list[int], tag: str, n: int = 3) -> list[float]:
    out = []
    for i in range(n):
        seconds, code, done = await timed(
            s, request(f"{tag}{i}", ids, PLAIN_TOKENS, ignore_eos=True)
        )
        assert code == "OK" and len(done.output_ids) == PLAIN_TOKENS, done
        out.append(seconds)
    return out


async def scenario(address: str, bundle: TokenizerBundle) -> dict:
    plain_ids = bundle.chat_prompt([{"role": "user", "content": "Tell me about the sea."}])
    json_ids = bundle.chat_prompt(
        [{"role": "user", "content": "Reply with a JSON object holding the integer t4242."}]
    )
    got: dict = {}
    async with grpc.aio.insecure_channel(address) as channel:
        s = pb_grpc.SglangSchedulerStub(channel)
        # The first grammar starts the worker's compile processes.
        _, code, done = await timed(
            s, request("warm", json_ids, 8, json_schema=nested_schema(3, "w"))
        )
        assert code == "OK", done
        got["quiet"] = await plain_latencies(s, plain_ids, "before")
        flood = [
            asyncio.ensure_future(
                timed(
                    s, request(f"flood{i}", json_ids, 8, json_schema=nested_schema(DEPTH, f"k{i}_"))
                )
            )
            for i in range(FLOOD)
        ]
        await asyncio.sleep(2.0)  # every process compiles a hard schema now
        got["tiny"] = await timed(s, request("tiny", json_ids, 60, json_schema=TINY_SCHEMA))
        got["busy"] = await plain_latencies(s, plain_ids, "busy")
        got["flood_still_compiling"] = sum(not f.done() for f in flood)
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        got["quiet"] += await plain_latencies(s, plain_ids, "after")
        got["tiny_again"] = await timed(s, request("tiny2", json_ids, 60, json_schema=TINY_SCHEMA))
    return got


def test_a_flood_of_hard_schemas_delays_only_its_own_requests(smollm2_address, bundle):
    got = asyncio.run(scenario(smollm2_address, bundle))
    seconds, code, done = got["tiny"]
    assert code == "OK", f"the tiny schema during the flood: {code} after {seconds:.1f} s: {done}"
    assert done.finish_reason == "stop"
    value = json.loads(bundle.tokenizer.decode(list(done.output_ids), skip_special_tokens=True))
    assert isinstance(value["t4242"], int)
    # The plain calls were measured while the flood still compiled.
    assert got["flood_still_compiling"] == FLOOD
    quiet, busy = statistics.median(got["quiet"]), statistics.median(got["busy"])
    print(
        f"plain {PLAIN_TOKENS}-token Generate: quiet {got['quiet']}, during the flood {got['busy']}"
    )
    assert busy <= 2 * quiet, f"{busy:.2f} s during the flood against {quiet:.2f} s quiet"
    seconds, code, done = got["tiny_again"]
    assert code == "OK" and done.finish_reason == "stop", (code, done)
