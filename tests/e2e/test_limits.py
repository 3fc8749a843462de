"""Request limits through the real gRPC API (simulated worker, small pool):
each limit's status code and message, gRPC's message size limit, unknown
fields, and overload (--max-queued-requests) under a flood."""

from __future__ import annotations

import asyncio
import collections
import math

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.sim_server import VOCAB, assert_idle_and_clean, simulated_server
from tests.e2e.support.system import greedy, stub

CONTEXT = 64 * 4  # --num-pages 64 --page-size 4: the pool caps the context
MAX_QUEUED = 8
GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    args = ("--max-n", "4", "--max-queued-requests", str(MAX_QUEUED), "--max-message-mb", "1")
    with simulated_server(tmp_path_factory.mktemp("limits"), scheduler_args=args) as addr:
        yield addr


def _request(ids=(1, 2, 3), sampling=None, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=sampling if sampling is not None else greedy(2),
        **fields,
    )


def _custom(key: str, value) -> pb.SamplingParams:
    params = Struct()
    params.update({key: value})
    return pb.SamplingParams(max_new_tokens=2, custom_params=params)


def _seed(value) -> pb.SamplingParams:
    return _custom("seed", value)


CASES = [
    (_request(ids=range(CONTEXT)), f"the prompt has {CONTEXT} tokens, the model's context is"),
    (_request(ids=[VOCAB]), f"outside the vocabulary [0, {VOCAB})"),
    (_request(ids=[]), "the input is empty"),
    (_request(sampling=greedy(CONTEXT)), "exceeds the context length"),
    (_request(sampling=greedy(2**32 - 1)), "max_new_tokens"),
    (_request(sampling=pb.SamplingParams(n=5)), "n must be at most 4, got 5"),
    (_request(sampling=pb.SamplingParams(stop=["a"] * 17)), "at most 16 stop strings, got 17"),
    (_request(sampling=pb.SamplingParams(stop=["a" * 257])), "at most 256 characters"),
    (_request(sampling=pb.SamplingParams(stop=[""])), "tokenizer"),  # simulated: none
    (_request(sampling=pb.SamplingParams(stop_token_ids=[VOCAB])), "stop_token_ids"),
    (
        _request(sampling=pb.SamplingParams(stop_token_ids=range(1025))),
        "at most 1024 stop_token_ids",
    ),
    (
        _request(sampling=pb.SamplingParams(logit_bias={str(i): 1.0 for i in range(1025)})),
        "logit_bias may name at most 1024 tokens, got 1025",
    ),
    (_request(sampling=pb.SamplingParams(logit_bias={str(VOCAB): 1.0})), "logit_bias has token"),
    (_request(sampling=pb.SamplingParams(logit_bias={"-1": 1.0})), "logit_bias has token"),
    (_request(sampling=pb.SamplingParams(logit_bias={"5": 1e6})), "logit_bias values must be"),
    (_request(sampling=pb.SamplingParams(logit_bias={"5": math.inf})), "logit_bias[5]"),
    (_request(top_logprobs_num=65, return_logprob=True), "top_logprobs_num must be in [0, 64]"),
    (_request(top_logprobs_num=-1), "top_logprobs_num"),
    (_request(token_ids_logprob=[VOCAB]), "token_ids_logprob has token ids outside"),
    (_request(token_ids_logprob=range(1025)), "token_ids_logprob may name at most 1024"),
    (_request(return_logprob=True, logprob_start_len=3), "logprob_start_len (3) must be <"),
    (_request(sampling=_seed(-1.0)), "custom_params.seed must be an integer"),
    (_request(sampling=_seed(2.0**64)), "custom_params.seed must be an integer"),
    (_request(sampling=_seed("x")), "custom_params.seed must be a finite number"),
    (_request(sampling=_custom("priority", "high")), "custom_params.priority must be a finite"),
    (_request(sampling=_custom("priority", 1.5)), "custom_params.priority must be an integer"),
    (_request(sampling=_custom("priority", 2.0**31)), "priority must be an integer in [-2^31"),
    (_request(sampling=_custom("routing_key", 7)), "custom_params.routing_key must be a string"),
    (_request(sampling=_custom("routing_key", "")), "routing_key must have 1 to 256 characters"),
    (_request(sampling=_custom("routing_key", "k" * 257)), "must have 1 to 256 characters"),
    (
        _request(sampling=_custom("speculative", "no")),
        "custom_params.speculative must be a boolean",
    ),
    (_request(sampling=_custom("speculative", 0)), "custom_params.speculative must be a boolean"),
    (_request(sampling=pb.SamplingParams(top_k=-2)), "top_k must be -1 or >= 1"),
    (_request(sampling=pb.SamplingParams(min_p=math.nan)), "min_p must be a finite number"),
]


@pytest.mark.parametrize(("request_", "needle"), CASES, ids=[n[:30] for _, n in CASES])
def test_each_limit_answers_invalid_argument_naming_it(address, request_, needle):
    s = stub(address)
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(request_, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert needle in err.value.details()


def test_the_largest_allowed_request_is_served(address):
    s = stub(address)
    (r,) = list(s.Generate(_request(ids=[1] * (CONTEXT - 2), sampling=greedy(2)), timeout=10))
    assert r.complete.completion_tokens == 2
    (r,) = list(s.Generate(_request(sampling=_seed(2.0**53)), timeout=10))
    assert r.complete.completion_tokens == 2
    for key, value in (
        ("priority", -(2.0**31)),
        ("routing_key", "k" * 256),
        ("speculative", False),
    ):
        (r,) = list(s.Generate(_request(sampling=_custom(key, value)), timeout=10))
        assert r.complete.completion_tokens == 2


def test_a_message_past_max_message_mb_is_resource_exhausted_by_grpc(address):
    s = stub(address)
    huge = _request(ids=[VOCAB - 1] * 400_000)  # ~1.2 MB of varints, limit 1 MiB
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(huge, timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    assert_idle_and_clean(s)


def test_unknown_fields_are_ignored(address):
    raw = _request(sampling=greedy(3), request_id="unknown-fields").SerializeToString()
    # field 999 (varint 7), field 1000 (length-delimited "hello"): not in the schema
    raw += bytes([0xB8, 0x3E, 0x07]) + bytes([0xC2, 0x3E, 0x05]) + b"hello"
    ch = grpc.insecure_channel(address)
    generate = ch.unary_stream(
        GENERATE,
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    (r,) = list(generate(raw, timeout=10))
    assert r.complete.completion_tokens == 3 and r.request_id == "unknown-fields"


def test_a_flood_is_refused_with_resource_exhausted_and_leaves_nothing(address):
    # At most 800 calls open at once: past 1000 calls the server has not yet
    # picked up, gRPC itself sheds calls with CANCELLED before any handler
    # runs (grpc.server.max_pending_requests); this tests our bound.
    gate = asyncio.Semaphore(800)

    async def one(s: pb_grpc.SglangSchedulerStub, i: int) -> tuple[str, str]:
        req = _request(ids=[i % 97 + 1, 2, 3], sampling=greedy(4, ignore_eos=True))
        async with gate:
            try:
                (r,) = [x async for x in s.Generate(req, timeout=60)]
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details()
        assert r.complete.completion_tokens == 4
        return "OK", ""

    async def flood() -> list[tuple[str, str]]:
        async with grpc.aio.insecure_channel(address) as ch:
            s = pb_grpc.SglangSchedulerStub(ch)
            return await asyncio.gather(*(one(s, i) for i in range(2000)))

    results = asyncio.run(flood())
    codes = collections.Counter(code for code, _ in results)
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["OK"] >= MAX_QUEUED and codes["RESOURCE_EXHAUSTED"] >= 100, codes
    message = next(m for c, m in results if c == "RESOURCE_EXHAUSTED")
    assert f"the limit (--max-queued-requests) is {MAX_QUEUED}" in message
    s = stub(address)
    (r,) = list(s.Generate(_request(sampling=greedy(3)), timeout=10))
    assert r.complete.completion_tokens == 3  # still serving
    assert_idle_and_clean(s)
