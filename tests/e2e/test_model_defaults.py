"""The model's declarations through the whole system: `radixserve serve` on a
tiny random Llama whose generation_config.json declares sampling defaults.
The worker reads them (GetInfo), GetModelInfo reports them with the BOS and
pad ids, and a request that leaves top_k and max_new_tokens unset takes the
model's (top_k 1: sampled requests come out greedy; 6 tokens), while one that
sets them keeps its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import serve, stub
from tests.worker_service.weights.support.tiny_checkpoints import tiny_model

GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_k": 1}
MAX_NEW = 6
PROMPT = [5, 17, 33, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    tiny_model("llama-tied").save_pretrained(model)
    (model / "generation_config.json").write_text(
        json.dumps(GENERATION | {"max_new_tokens": MAX_NEW})
    )
    tokenizer = {"pad_token": "<pad>", "added_tokens_decoder": {"3": {"content": "<pad>"}}}
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    args = ("--model", str(Path(model)), "--device", "cpu", "--log-level", "warning")
    with serve(tmp_path_factory.mktemp("serve"), *args) as address:
        yield stub(address)


def _generate(s, rid: str, seed: int, **sampling) -> list[int]:
    params = pb.SamplingParams(temperature=1.0, ignore_eos=True, **sampling)
    custom = Struct()
    custom.update({"seed": seed})
    params.custom_params.CopyFrom(custom)
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=params
    )
    (done,) = s.Generate(req, timeout=120)
    return list(done.complete.output_ids)


def test_model_info_reports_what_the_model_declares(server):
    info = server.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.bos_token_id, info.pad_token_id, list(info.eos_token_ids)) == (1, 3, [2])
    declared = json.loads(info.default_sampling_params_json)
    assert declared == {"temperature": 0.6, "top_k": 1, "max_new_tokens": MAX_NEW}


def test_unset_fields_take_the_models_defaults(server):
    greedy = pb.GenerateRequest(
        request_id="greedy",
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True),
    )
    (want,) = server.Generate(greedy, timeout=120)
    want = list(want.complete.output_ids)
    assert len(want) == MAX_NEW  # max_new_tokens unset: the model's 6
    # temperature 1 but top_k unset: the model's top_k 1 makes every seed greedy
    assert all(_generate(server, f"d{i}", i) == want for i in range(4))
    # top_k set (-1: every token) and max_new_tokens set: the request's own
    sampled = [_generate(server, f"s{i}", i, top_k=-1, max_new_tokens=20) for i in range(4)]
    assert all(len(out) == 20 for out in sampled)
    assert len({tuple(out) for out in sampled}) > 1
