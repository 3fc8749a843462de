"""A reasoning model with structured output, through the gRPC API and through
the SMG gateway with ``--reasoning-parser qwen3``.

The model is a tiny random-init Qwen3 checkpoint built to think on cue
(tests/e2e/support/reasoning_model.py): its chat template opens ``<think>``
in the prompt (unless enable_thinking is false), and left alone, greedy, it
says ``Let me think</think> Sure`` and then babbles.

What this proves: the wiring. require_reasoning is accepted; the grammar is
deferred until ``</think>`` (the thought, which no JSON grammar allows,
comes through) and applies after it (" Sure" becomes the schema's JSON);
reasoning_tokens counts the thought and its end token; the gateway sets
require_reasoning on a chat whose template thinks (not when the request
turns thinking off), splits reasoning from content, and the content is
valid JSON. What it does not prove: anything about a real model's
reasoning (this one's thought is wired into its weights).
"""

from __future__ import annotations

import json
import types

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.openai_http import post
from tests.e2e.support.reasoning_model import ANSWER, SCHEMA, THOUGHT, build, prompt_text
from tests.e2e.support.smg_gateway import start_gateway
from tests.e2e.support.system import greedy, serve, stub

pytestmark = pytest.mark.slow  # exports the default model's tokenizer, builds a checkpoint

REASONING_TOKENS = 4  # "Let", " me", " think", "</think>"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("reasoning")
    ids = build(tokenizer_dir, tmp / "model")
    args = ("--model", str(tmp / "model"), "--served-model-name", "sim", "--worker-threads", "1")
    with serve(tmp, *args, "--log-level", "warning") as address:
        yield types.SimpleNamespace(tmp=tmp, address=address, ids=ids)


def generate(served, *, require_reasoning: bool, schema: bool) -> pb.GenerateComplete:
    sampling = greedy(24)
    if schema:
        sampling.json_schema = json.dumps(SCHEMA)
    request = pb.GenerateRequest(
        request_id=f"r-{require_reasoning}-{schema}",
        tokenized=pb.TokenizedInput(original_text=prompt_text()),
        sampling_params=sampling,
        require_reasoning=require_reasoning,
    )
    (response,) = list(stub(served.address).Generate(request, timeout=120))
    return response.complete


def text(served, ids) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(served.tmp / "model" / "tokenizer.json"))
    return tok.decode(list(ids), skip_special_tokens=False)


def test_the_grammar_waits_for_the_end_of_the_thought(served):
    done = generate(served, require_reasoning=True, schema=True)
    assert text(served, done.output_ids) == f"{THOUGHT}</think>{ANSWER}<|im_end|>"
    assert done.finish_reason == "stop"
    assert done.reasoning_tokens == REASONING_TOKENS


def test_without_require_reasoning_the_grammar_starts_at_once(served):
    done = generate(served, require_reasoning=False, schema=True)
    out = text(served, done.output_ids)
    assert THOUGHT not in out and json.loads(out.removesuffix("<|im_end|>")) == {"answer": "yes"}
    assert done.reasoning_tokens == 0


def test_reasoning_is_counted_without_a_grammar(served):
    done = generate(served, require_reasoning=True, schema=False)
    assert text(served, done.output_ids).startswith(f"{THOUGHT}</think> Sure")
    assert done.reasoning_tokens == REASONING_TOKENS


def test_a_structured_chat_through_the_gateway_returns_reasoning_and_json(served):
    unit = types.SimpleNamespace(address=served.address)
    proc, base = start_gateway(
        served.tmp, [unit], probe_tokens=4, extra_args=("--reasoning-parser", "qwen3")
    )
    try:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "Is this a test?"}],
            "temperature": 0,
            "max_tokens": 24,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            },
        }
        choice = post(base + "/v1/chat/completions", body)
        message = choice["choices"][0]["message"]
        assert message["reasoning_content"].strip() == THOUGHT, choice
        assert json.loads(message["content"]) == {"answer": "yes"}, choice
        assert choice["choices"][0]["finish_reason"] == "stop"
        # Thinking off: the template closes the section, the gateway sends no
        # require_reasoning, and the grammar holds from the first token.
        off = post(
            base + "/v1/chat/completions",
            {**body, "chat_template_kwargs": {"enable_thinking": False}},
        )
        message = off["choices"][0]["message"]
        assert not message.get("reasoning_content"), off
        assert json.loads(message["content"]) == {"answer": "yes"}, off
    finally:
        proc.terminate()
        proc.wait(10)
