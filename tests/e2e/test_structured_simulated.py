"""Structured generation with the simulated model (its vocabulary: byte t is
token t, 256 ends a grammar), through the real processes:

- property tests: for random JSON schemas (hypothesis-jsonschema) every
  completed output parses and validates; for random regexes every output
  fully matches;
- the same outputs whatever happens around them: overlap depths 0/1/2,
  chunked prefill, retraction (a small KV pool), and a worker SIGKILLed mid
  run (the re-joined requests rebuild their grammar state from the tokens
  they have).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.system import BIN, free_port, process, separate, stub, worker_on_port

EOS = 256
WORKER = ["--model", "simulated", "--simulated-vocab", "1024", "--log-level", "warning"]


def text_of(ids: list[int]) -> str:
    """The output's text: its byte tokens, as UTF-8 (the grammar works on code
    points, so a multi-byte character is several tokens). xgrammar 0.2.9 lets
    through UTF-8-encoded surrogates (ED A0..BF ..), which strict UTF-8 refuses."""
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="surrogatepass")


def parse_json(text: str) -> object:
    """xgrammar 0.2.9 admits raw control characters inside strings bounded by
    maxLength/minLength, which strict JSON parsers refuse; everything else
    about the output is what the schema asks."""
    return json.loads(text, strict=False)


def constrained(rid: str, prompt: list[int], max_new: int, **constraint) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(
            temperature=0.7, max_new_tokens=max_new, n=constraint.pop("n", 1), **constraint
        ),
    )


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    with separate(tmp_path_factory.mktemp("sg"), WORKER, ["--log-level", "warning"]) as addr:
        yield addr


# ------------------------------------------------------------------ properties
# Schemas are drawn by hypothesis-jsonschema from a schema of schemas: objects
# of a few typed properties (what response_format users send), nested once.
LEAF_TYPES = [
    {"type": "integer"},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "number"},
    {"type": "string", "maxLength": 8},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
]
META_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "object"},
        "properties": {
            "type": "object",
            "minProperties": 1,
            "maxProperties": 4,
            "propertyNames": {"pattern": "^[a-z]{1,6}$"},
            "additionalProperties": {
                "anyOf": [
                    *({"const": leaf} for leaf in LEAF_TYPES),
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "object"},
                            "properties": {
                                "type": "object",
                                "minProperties": 1,
                                "maxProperties": 2,
                                "propertyNames": {"pattern": "^[a-z]{1,4}$"},
                                "additionalProperties": {
                                    "anyOf": [{"const": leaf} for leaf in LEAF_TYPES]
                                },
                            },
                        },
                        "required": ["type", "properties"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
    },
    "required": ["type", "properties"],
    "additionalProperties": False,
}


def _closed(schema: dict) -> dict:
    """Every property required, no others: the outputs must be exactly these."""
    props = {
        k: _closed(v) if v.get("type") == "object" else v for k, v in schema["properties"].items()
    }
    return {**schema, "properties": props, "required": sorted(props), "additionalProperties": False}


SCHEMAS = from_schema(META_SCHEMA).map(_closed)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_every_completed_output_validates_against_its_schema(address, schema, seed):
    req = constrained(f"s{seed}", [seed % 256, 7, 9], 400, json_schema=json.dumps(schema))
    (done,) = list(stub(address).Generate(req, timeout=60))
    c = done.complete
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert c.matched_token_id == EOS and c.output_ids[-1] == EOS
        text = text_of(list(c.output_ids))
        jsonschema.validate(parse_json(text), schema)


REGEX_PARTS = st.sampled_from(
    ["[a-c]", "[0-9]{1,3}", "(ab|cd)", "x?", "[A-Z]+", r"\.", "(yes|no)", "[a-z]{2}"]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(REGEX_PARTS, min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_every_output_fully_matches_its_regex(address, parts, seed):
    regex = "".join(parts)
    req = constrained(f"r{seed}", [seed % 256, 1], 80, regex=regex)
    (done,) = list(stub(address).Generate(req, timeout=60))
    c = done.complete
    assert c.finish_reason == "stop" and c.output_ids[-1] == EOS
    assert re.fullmatch(regex, text_of(list(c.output_ids)))


def test_a_grammar_that_does_not_compile_is_refused_with_the_compilers_message(address):
    for field, text, needle in [
        ("regex", "a(b", "parenthesis is not closed"),
        ("json_schema", '{"type": "nope"}', "nope"),
        ("ebnf_grammar", "root ::= ", ""),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub(address).Generate(constrained("bad", [1], 5, **{field: text}), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details()


# ------------------------------------------------------ identical outputs
def workload() -> list[pb.GenerateRequest]:
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        }
    )
    kinds = [
        {"json_schema": schema},
        {"regex": "(sun|rain|snow)-[0-9]{2,4}!"},
        {"ebnf_grammar": 'root ::= "<" [a-z]+ ">" [0-9]*'},
    ]
    # Two long outputs first: together they outgrow the "retraction" pool.
    reqs = [constrained(f"long{i}", [i + 1] * 10, 200, regex="[a-z]{180}") for i in range(2)]
    for i in range(12):
        prompt = [(i * 37 + j) % 256 for j in range(20 + 9 * i)]  # up to ~120 tokens
        n = 2 if i % 4 == 0 else 1
        reqs.append(constrained(f"w{i}", prompt, 120, n=n, **kinds[i % 3]))
    return reqs


async def run_all(address: str, on_half=None) -> dict[str, list[list[int]]]:
    reqs = workload()
    done = [0]

    async def one(s, req) -> tuple[str, list[list[int]]]:
        outs = []
        async for r in s.Generate(req, timeout=240):
            outs.append(list(r.complete.output_ids))
        done[0] += 1
        if on_half is not None and done[0] == 3:
            on_half()
        return req.request_id, outs

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        return dict(await asyncio.gather(*(one(s, r) for r in reqs)))


@pytest.fixture(scope="module")
def baseline(address):
    return asyncio.run(run_all(address))


@pytest.mark.parametrize(
    ("name", "scheduler_args", "worker_args"),
    [
        ("overlap depth 0", ["--overlap-depth", "0"], []),
        ("overlap depth 1", ["--overlap-depth", "1"], []),
        ("chunked prefill", ["--chunked-prefill-size", "16"], []),
        # A small pool and an admission that expects no growth: decodes run out
        # of pages and requests are retracted, then re-prefilled.
        (
            "retraction",
            ["--schedule-conservativeness", "0.001"],
            ["--num-pages", "30", "--page-size", "8", "--simulated-step-ms", "5"],
        ),
    ],
)
def test_outputs_do_not_depend_on_how_they_were_scheduled(
    baseline, tmp_path, name, scheduler_args, worker_args
):
    metrics = free_port()
    scheduler = ["--log-level", "warning", "--metrics-port", str(metrics), *scheduler_args]
    with separate(tmp_path, WORKER + worker_args, scheduler) as address:
        got = asyncio.run(run_all(address))
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
    assert got == baseline, name
    if name == "retraction":
        (line,) = [x for x in scraped.splitlines() if x.startswith("radixserve_retractions_total")]
        assert float(line.split()[-1]) >= 1


@pytest.mark.slow
def test_outputs_survive_a_worker_killed_mid_run(baseline, tmp_path):
    port = free_port()
    slow = [*WORKER, "--simulated-step-ms", "20"]
    with worker_on_port(tmp_path, port, slow, "worker") as worker:
        sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
        with process(tmp_path, "scheduler", [*sched, "--log-level", "warning"]) as sport:
            address = f"127.0.0.1:{sport}"
            restarted = []

            def kill() -> None:
                worker.send_signal(signal.SIGKILL)
                worker.wait()
                restarted.append(
                    _restart(tmp_path, port, slow)  # same port: the scheduler reconnects
                )

            try:
                got = asyncio.run(run_all(address, on_half=kill))
            finally:
                for proc in restarted:
                    proc.__exit__(None, None, None)
    assert restarted and got == baseline


def _restart(tmp: Path, port: int, args: list[str]):
    ctx = worker_on_port(tmp, port, args, "worker2")
    ctx.__enter__()
    time.sleep(0.1)
    return ctx
