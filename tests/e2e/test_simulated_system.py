"""radixserve-worker (simulated model) and radixserve-scheduler deployed apart:
concurrency, bad input, and the RPCs around Generate."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.simulated_model import simulated_token
from tests.e2e.support.system import greedy, separate, stub

VOCAB = 32000


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sim")
    worker = ["--model", "simulated", "--simulated-step-ms", "2", "--log-level", "warning"]
    with separate(tmp, worker, ["--log-level", "warning", "--max-n", "8"]) as addr:
        yield addr


def expected(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(simulated_token(context, VOCAB))
        context.append(out[-1])
    return out


def test_64_concurrent_streams_are_all_correct(address):
    async def one(s, i: int) -> tuple[list[int], list[int]]:
        prompt = [(7 * i + j) % VOCAB for j in range(5 + i % 17)]
        req = pb.GenerateRequest(
            request_id=f"c{i}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=greedy(20 + i % 13, ignore_eos=True),
            stream=True,
        )
        tokens = [
            t async for r in s.Generate(req) if r.HasField("chunk") for t in r.chunk.token_ids
        ]
        return prompt, tokens

    async def run() -> list:
        async with grpc.aio.insecure_channel(address) as ch:
            s = pb_grpc.SglangSchedulerStub(ch)
            return await asyncio.gather(*(one(s, i) for i in range(64)))

    for prompt, tokens in asyncio.run(run()):
        assert tokens == expected(prompt, len(tokens)) and len(tokens) >= 20


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        (pb.SamplingParams(temperature=-0.5), "temperature"),
        (pb.SamplingParams(temperature=math.nan), "temperature"),
        (pb.SamplingParams(top_p=1.5), "top_p"),
        (pb.SamplingParams(top_p=-0.1), "top_p"),
        (pb.SamplingParams(n=9), "n must be at most 8"),
        (pb.SamplingParams(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
        (pb.SamplingParams(logit_bias={"abc": 1.0}), "logit_bias"),
        (pb.SamplingParams(regex=" "), "regex is empty"),
        (pb.SamplingParams(regex="a("), "regex: Regex parsing error"),
        (pb.SamplingParams(stop=["x"]), "tokenizer"),  # the simulated model has none
    ],
)
def test_bad_requests_get_invalid_argument(address, sampling, needle):
    s = stub(address)
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[1, 2]), sampling_params=sampling
    )
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    (ok,) = list(
        s.Generate(
            pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=[1, 2]), sampling_params=greedy(3)
            )
        )
    )
    assert ok.complete.completion_tokens == 3  # the server keeps serving


def test_top_p_zero_means_unset_and_unknown_aborts_succeed(address):
    s = stub(address)
    (r,) = list(
        s.Generate(
            pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=[1, 2]),
                sampling_params=pb.SamplingParams(top_p=0.0, max_new_tokens=2),
            )
        )
    )
    assert r.complete.completion_tokens == 2
    ack = s.Abort(pb.AbortRequest(request_id="nobody"))
    assert ack.success and ack.message == "Request nobody aborted"


def test_unimplemented_rpcs_say_so(address):
    s = stub(address)
    calls = [
        lambda: s.StartProfile(cpb.StartProfileRequest()),
        lambda: s.StopProfile(cpb.StopProfileRequest()),
        lambda: list(s.GetTokenizer(cpb.GetTokenizerRequest())),  # no tokenizer: precondition
        lambda: s.Embed(pb.EmbedRequest()),  # implemented: an empty input is refused
    ]
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        codes.append(err.value.code())
        details = err.value.details()
        assert "radixserve" in details or "tokenizer" in details or "empty" in details
    assert codes[:2] == [grpc.StatusCode.UNIMPLEMENTED] * 2
    assert codes[2] == grpc.StatusCode.FAILED_PRECONDITION
    assert codes[3] == grpc.StatusCode.INVALID_ARGUMENT


def test_health_services_reflection_and_server_info(address):
    ch = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", "sglang.grpc.scheduler.SglangScheduler"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    (resp,) = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {x.name for x in resp.list_services_response.service}
    assert {"sglang.grpc.scheduler.SglangScheduler", "grpc.health.v1.Health"} <= names
    s = pb_grpc.SglangSchedulerStub(ch)
    assert s.HealthCheck(pb.HealthCheckRequest()).healthy
    info = s.GetServerInfo(pb.GetServerInfoRequest())
    assert info.server_type == "grpc" and info.server_args["tp_size"] == 1
    loads = s.GetLoads(pb.GetLoadsRequest(include=["core", "memory"]))
    assert loads.loads[0].max_total_num_tokens > 0
    with pytest.raises(grpc.RpcError) as err:
        s.GetLoads(pb.GetLoadsRequest(include=["bogus"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lora_id", "adapter-1", "lora_id 'adapter-1' names no loaded LoRA adapter"),
        ("custom_logit_processor", "gASV...", "custom_logit_processor"),
        ("data_parallel_rank", 3, "data_parallel_rank: this scheduler has one"),
        # the simulated model has no tokenizer, so no </think> to wait for
        ("require_reasoning", True, "require_reasoning: this model's vocabulary has no"),
    ],
)
def test_fields_nobody_would_read_are_refused_by_name(address, field, value, message):
    req = pb.GenerateRequest(
        request_id=f"refused-{field}",
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=greedy(2),
        **{field: value},
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub(address).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_disaggregation_is_refused_by_name(address):
    req = pb.GenerateRequest(
        request_id="disagg",
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=greedy(2),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="h", bootstrap_room=1),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub(address).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "disaggregated_params" in e.value.details()
