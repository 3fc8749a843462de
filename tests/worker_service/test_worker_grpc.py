"""A real worker process driven over gRPC with hand-built plans."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.simulated_model import simulated_token
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_process import PlanStream, greedy_over_grpc, worker_process

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

PAGE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = tiny_model("qwen2-qkv-bias", path)
    with worker_process(
        path, "--model", str(path), "--page-size", str(PAGE), "--num-pages", "64"
    ) as addr:
        yield hf, addr


def test_get_info_health_and_reflection(tiny):
    _, addr = tiny
    channel = grpc.insecure_channel(addr)
    info = worker_pb2_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest())
    assert info.protocol_version == 3 and info.model.architecture == "Qwen2ForCausalLM"
    assert (info.page_size, info.num_pages, info.tp_size) == (PAGE, 64, 1)
    assert (info.model.num_heads, info.model.num_kv_heads, info.model.vocab_size) == (4, 2, 256)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "radixserve.worker.v1.Worker"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in resp.list_services_response.service}
    assert {"radixserve.worker.v1.Worker", "grpc.health.v1.Health"} <= names
    channel.close()


def test_greedy_generation_over_grpc_matches_hf(tiny):
    hf, addr = tiny
    prompts = [[5, 17, 99, 3, 250, 41, 8], [200, 1, 2]]
    stream = PlanStream(addr)
    outputs = greedy_over_grpc([stream], prompts, 12, PAGE)
    stream.close()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(hf, prompt, 12)[0]


def test_bad_plans_get_clear_errors_and_change_nothing(tiny):
    hf, addr = tiny
    stream = PlanStream(addr)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
    good = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    good.joins.add(slot=0, rid="a", sampling=greedy, prompt_len=3)
    good.extends.add(slot=0, start_pos=0, input_ids=[200, 1, 2], new_pages=[0], sample=True)
    first = stream.run(good)
    assert not first.error

    def decode(step: int, slot: int = 0, pos: int = 3, new_page: int = 0) -> pb.StepPlan:
        p = pb.StepPlan(step_id=step, mode=pb.FORWARD_MODE_DECODE)
        p.decode_slots.append(slot)
        p.decode_positions.append(pos)
        p.decode_new_pages.append(new_page)
        return p

    bad_vocab = pb.StepPlan(step_id=9)
    bad_vocab.joins.add(slot=1, rid="b", sampling=greedy, prompt_len=1)
    bad_vocab.extends.add(slot=1, start_pos=0, input_ids=[999], new_pages=[1], sample=True)
    cases = [
        (decode(2, slot=7), "does not hold"),
        (decode(3, pos=5), "position 5"),
        (decode(4, pos=3, new_page=65), "outside the pool"),
        (bad_vocab, "outside the vocabulary"),
    ]
    for plan, needle in cases:
        result = stream.run(plan)
        assert needle in result.error, result.error
        assert not result.token_ids
    # The rejected plans changed nothing: decoding continues exactly.
    tokens = [first.token_ids[0]]
    for step in range(3):
        pos = 3 + step
        r = stream.run(decode(10 + step, pos=pos, new_page=2 if pos % PAGE == 0 else 0))
        assert not r.error, r.error
        tokens.append(r.token_ids[0])
    stream.close()
    assert tokens == hf_greedy(hf, [200, 1, 2], 4)[0]


def test_a_new_stream_starts_from_no_state(tiny):
    _, addr = tiny
    first = PlanStream(addr)
    assert greedy_over_grpc([first], [[1, 2, 3]], 1, PAGE)[0]
    second = PlanStream(addr)
    plan = pb.StepPlan(step_id=5, mode=pb.FORWARD_MODE_DECODE)
    plan.decode_slots.append(0)
    plan.decode_positions.append(3)
    plan.decode_new_pages.append(0)
    assert "does not hold" in second.run(plan).error
    second.close()
    first.close()


def test_simulated_model_takes_its_step_time_and_hashes_the_context(tmp_path):
    with worker_process(tmp_path, "--model", "simulated", "--simulated-step-ms", "30") as addr:
        stream = PlanStream(addr)
        prompt = [3, 1, 4, 1, 5]
        t0 = time.perf_counter()
        (out,) = greedy_over_grpc([stream], [prompt], 3, 16)
        assert time.perf_counter() - t0 >= 0.09
        stream.close()
    context = list(prompt)
    for token in out:
        assert token == simulated_token(context, 32000)
        context.append(token)
