"""Structured generation with the real default model (SmolLM2-135M-Instruct on
CPU): through the public API (every kind of constraint, greedy and sampled at
temperature 1.0 with seeds, n > 1, streaming, logprobs of the masked
distribution) and through the SMG gateway's OpenAI API (response_format,
tools with tool_choice, and the gateway's regex / ebnf extensions)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from tokenizers import Tokenizer

from clients.tokenizer_bundle import TokenizerBundle
from tests.e2e.support.openai_http import post
from tests.e2e.support.system import stub

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def server(smollm2_address):
    return stub(smollm2_address)


@pytest.fixture(scope="module")
def bundle(server) -> TokenizerBundle:
    return TokenizerBundle.from_chunks(server.GetTokenizer(cpb.GetTokenizerRequest()))


def chat(bundle: TokenizerBundle, question: str) -> list[int]:
    return bundle.chat_prompt([{"role": "user", "content": question}])


def generate(server, ids, sampling: pb.SamplingParams, **kw) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sampling)
    for key, value in kw.items():
        setattr(req, key, value)
    return list(server.Generate(req, timeout=300))


def text(tokenizer: Tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def seeded(seed: int) -> Struct:
    s = Struct()
    s.update({"seed": seed})
    return s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(server, bundle, temperature):
    ids = chat(bundle, "Describe a person as JSON: name, age and city.")
    seeds = [0] if temperature == 0 else [1, 2, 3, 4]
    for seed in seeds:
        sampling = pb.SamplingParams(
            temperature=temperature,
            max_new_tokens=120,
            json_schema=json.dumps(PERSON),
            custom_params=seeded(seed),
        )
        (done,) = generate(server, ids, sampling)
        c = done.complete
        assert c.finish_reason == "stop", text(bundle.tokenizer, c.output_ids)
        jsonschema.validate(json.loads(text(bundle.tokenizer, c.output_ids)), PERSON)


def test_regex_ebnf_and_structural_tag(server, bundle):
    tok = bundle.tokenizer
    regex = r"(yes|no), because [a-z ]{5,40}\."
    (done,) = generate(
        server,
        chat(bundle, "Is the sea blue? Answer yes or no and say why."),
        pb.SamplingParams(temperature=0.0, max_new_tokens=60, regex=regex),
    )
    assert done.complete.finish_reason == "stop"
    assert re.fullmatch(regex, text(tok, done.complete.output_ids))

    ebnf = 'root ::= "The answer is " answer "."\nanswer ::= "Paris" | "Rome" | "Oslo"'
    (done,) = generate(
        server,
        chat(bundle, "What is the capital of France?"),
        pb.SamplingParams(temperature=0.0, max_new_tokens=30, ebnf_grammar=ebnf),
    )
    assert text(tok, done.complete.output_ids) == "The answer is Paris."

    schema = WEATHER["function"]["parameters"]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<function=get_weather>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</function>",
        },
    }
    (done,) = generate(
        server,
        chat(bundle, "Call get_weather for Paris in Celsius."),
        pb.SamplingParams(temperature=0.0, max_new_tokens=60, structural_tag=json.dumps(tag)),
    )
    out = text(tok, done.complete.output_ids)
    m = re.fullmatch(r"<function=get_weather>(.*)</function>", out, re.S)
    assert m, out
    jsonschema.validate(json.loads(m.group(1)), schema)


def test_n_streaming_and_the_logprobs_of_the_masked_distribution(server, bundle):
    ids = chat(bundle, "Is water wet? Answer yes or no.")
    sampling = pb.SamplingParams(
        temperature=1.0, max_new_tokens=8, regex="(yes|no)", n=3, custom_params=seeded(7)
    )
    responses = generate(
        server,
        ids,
        sampling,
        stream=True,
        return_logprob=True,
        logprob_start_len=-1,
        top_logprobs_num=5,
    )
    completes = [r.complete for r in responses if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    yes_no = {bundle.encode("yes")[0], bundle.encode("no")[0]}
    for index in range(3):
        mine = [c for c in chunks if c.index == index]
        tokens = [t for c in mine for t in c.token_ids]
        assert text(bundle.tokenizer, tokens) in ("yes", "no")
        # Logprobs of the masked distribution: the tokens the grammar allows
        # first (those of "yes" and "no", or a prefix) share all of it; every
        # other token of the top 5 has none.
        top = mine[0].output_logprobs.top_logprobs[0]
        pairs = list(zip(top.token_ids, top.values, strict=True))
        allowed = [(t, v) for t, v in pairs if v > -math.inf]
        for t, _ in allowed:
            piece = bundle.decode([t])
            assert "yes".startswith(piece) or "no".startswith(piece), piece
        assert 0.9 < sum(math.exp(v) for _, v in allowed) <= 1.0 + 1e-5
        assert any(t in yes_no for t, _ in allowed)


# --------------------------------------------------------------- gateway
def ask(gateway, **extra) -> dict:
    base, model = gateway
    body = {"model": model, "temperature": 0, "max_tokens": 200, **extra}
    return post(base + "/v1/chat/completions", body)["choices"][0]


def test_response_format_through_the_gateway(gateway):
    msgs = [{"role": "user", "content": "Describe a person as JSON: name, age and city."}]
    choice = ask(
        gateway,
        messages=msgs,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    short = [{"role": "user", "content": 'Give {"ok": true} as JSON, nothing else.'}]
    choice = ask(gateway, messages=short, response_format={"type": "json_object"})
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_through_the_gateway(gateway, tool_choice):
    msgs = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    choice = ask(gateway, messages=msgs, tools=[WEATHER], tool_choice=tool_choice, max_tokens=60)
    calls = choice["message"].get("tool_calls") or []
    assert calls, choice
    for call in calls:
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
        )


def test_the_gateways_regex_and_ebnf_extensions(gateway):
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    choice = ask(gateway, messages=msgs, regex="(yes|no)")
    assert choice["message"]["content"] in ("yes", "no")
    choice = ask(gateway, messages=msgs, ebnf='root ::= "Answer: " ("A" | "B")')
    assert choice["message"]["content"] in ("Answer: A", "Answer: B")
