"""Prefill/decode disaggregation through the real gateway: smg 1.13 in PD
mode (`--pd-disaggregation --prefill grpc://P BOOTSTRAP_PORT --decode
grpc://D`) in front of a prefill unit and a decode unit of the default model
on loopback. Every answer must equal the co-located unit's (the session's
`gateway` fixture, same model and float path), and neither unit may keep a
page once the requests are done."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.openai_http import post, post_stream
from tests.e2e.support.pd_units import pd_units
from tests.e2e.support.smg_gateway import start_gateway
from tests.e2e.support.system import greedy, stub, used_tokens, wait_until

PROMPT = "Explain in two sentences why the sky is blue, then name three colours."


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    prefill, decode, bport = pd_units(tmp)
    prefill.bootstrap = ("127.0.0.1", bport)
    for unit in (prefill, decode):
        unit.start()
    proc = None
    try:
        args = ["--pd-disaggregation", "--prefill", f"grpc://{prefill.address}", str(bport)]
        args += ["--decode", f"grpc://{decode.address}"]
        proc, base = start_gateway(tmp, [prefill, decode], probe_chat=False, worker_args=args)
        yield base, prefill, decode
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for unit in (prefill, decode):
            unit.kill()


def _chat(model: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }


def _streamed_text(events: list[dict], n: int = 1) -> list[str]:
    texts = [""] * n
    for event in events:
        for choice in event.get("choices", []):
            delta = choice.get("delta")
            piece = delta.get("content") if delta is not None else choice.get("text")
            texts[choice["index"]] += piece or ""
    return texts


def test_chat_streamed_and_not_equals_colocated(pd, gateway):
    base, _, _ = pd
    ref_base, model = gateway
    ref = post(ref_base + "/v1/chat/completions", _chat(model))
    got = post(base + "/v1/chat/completions", _chat(model))
    text = ref["choices"][0]["message"]["content"]
    assert text and got["choices"][0]["message"]["content"] == text
    assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    events = post_stream(base + "/v1/chat/completions", _chat(model))
    assert _streamed_text(events) == [text]


def test_completion_streamed_and_not_equals_colocated(pd, gateway):
    base, _, _ = pd
    ref_base, model = gateway
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16}
    body["temperature"] = 0
    ref = post(ref_base + "/v1/completions", body)["choices"][0]["text"]
    assert ref and post(base + "/v1/completions", body)["choices"][0]["text"] == ref
    assert _streamed_text(post_stream(base + "/v1/completions", body)) == [ref]


def test_chat_logprobs_equal_colocated(pd, gateway):
    base, _, _ = pd
    ref_base, model = gateway
    body = _chat(model, logprobs=True, top_logprobs=2, max_tokens=12)
    ref = post(ref_base + "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    got = post(base + "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert [g["token"] for g in got] == [r["token"] for r in ref] and len(ref) == 12
    for g, r in zip(got, ref, strict=True):
        assert g["logprob"] == pytest.approx(r["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in r["top_logprobs"]]


def test_prompt_and_output_logprobs_over_grpc_equal_colocated(pd, smollm2_address):
    """What the gateway merges: the prefill unit's prompt logprobs and the
    decode unit's output, sent to both units at once with one room."""
    _, prefill, decode = pd
    ids = list(range(300, 340))

    def request(dp: pb.DisaggregatedParams | None) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=f"lp-{dp is not None}",
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=greedy(10),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            disaggregated_params=dp,
        )

    ref = _complete(stub(smollm2_address).Generate(request(None), timeout=60))
    host, port = prefill.bootstrap
    dp = pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=port, bootstrap_room=7)
    with ThreadPoolExecutor(2) as pool:
        p_call = pool.submit(lambda: list(stub(prefill.address).Generate(request(dp))))
        d_call = pool.submit(lambda: _complete(stub(decode.address).Generate(request(dp))))
        p_all, d = p_call.result(60), d_call.result(60)
    # The prefill unit answers at once with a chunk without tokens (the
    # gateway's silence bound), then its one token.
    assert p_all[0].HasField("chunk") and not p_all[0].chunk.token_ids
    p = _complete(p_all)
    assert list(d.output_ids) == list(ref.output_ids)
    assert list(p.output_ids) == list(ref.output_ids)[:1]
    got, want = d.output_logprobs, ref.output_logprobs
    assert list(got.token_logprobs) == pytest.approx(list(want.token_logprobs), abs=1e-4)
    assert [list(t.token_ids) for t in got.top_logprobs] == [
        list(t.token_ids) for t in want.top_logprobs
    ]
    pin, rin = p.input_logprobs, ref.input_logprobs
    assert len(rin.token_logprobs) == len(ids)
    values = [[t.value for t in x.token_logprobs[1:]] for x in (pin, rin)]
    assert values[0] == pytest.approx(values[1], abs=1e-4)


def _complete(responses) -> pb.GenerateComplete:
    for r in responses:
        if r.HasField("complete"):
            return r.complete
    raise AssertionError("no GenerateComplete")


def test_n_samples_each_equal_colocated(pd, gateway):
    base, _, _ = pd
    ref_base, model = gateway
    ref = post(ref_base + "/v1/chat/completions", _chat(model))["choices"][0]["message"]
    got = post(base + "/v1/chat/completions", _chat(model, n=3))
    assert len(got["choices"]) == 3
    assert {c["message"]["content"] for c in got["choices"]} == {ref["content"]}
    events = post_stream(base + "/v1/chat/completions", _chat(model, n=2))
    assert _streamed_text(events, 2) == [ref["content"]] * 2


def test_structured_output_equals_colocated(pd, gateway):
    base, _, _ = pd
    ref_base, model = gateway
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    body = _chat(model, response_format=fmt, max_tokens=32)
    ref = post(ref_base + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    got = post(base + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert got == ref
    assert json.loads(got)["colour"] in ("red", "green", "blue")


def test_loads_report_roles_and_no_page_is_kept(pd):
    _, prefill, decode = pd
    for unit, mode in ((prefill, "prefill"), (decode, "decode")):
        s = stub(unit.address)
        loads = s.GetLoads(pb.GetLoadsRequest(include=["disagg"]), timeout=10)
        disagg = loads.loads[0].disaggregation
        assert disagg.mode == mode
        wait_until(lambda s=s: used_tokens(s) == 0, what=f"the {mode} unit's pages free")


def test_prefills_longer_than_the_gateways_silence_bound(pd, gateway):
    """smg 1.13 gives up on a prefill leg silent for 3 s while its unit
    answers no other leg: three ~1,500-token prompts at once keep this
    CPU prefill unit busy longer than that."""
    base, _, _ = pd
    _, model = gateway
    words = " ".join(PROMPT.split() * 120)

    def one(i: int) -> str:
        body = {"model": model, "prompt": f"{i}: {words}", "max_tokens": 4, "temperature": 0}
        return post(base + "/v1/completions", body)["choices"][0]["finish_reason"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        reasons = list(pool.map(one, range(3)))
    assert reasons == ["length"] * 3
    assert time.monotonic() - t0 > 3  # the bound would have passed
