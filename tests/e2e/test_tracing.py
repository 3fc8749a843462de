"""Traces across the real services, exported to a real OTLP receiver.

The exporters' batch delay is set far beyond the test's length, so every
span arrives through the flush on a clean stop (SIGTERM): nothing is lost.
"""

from __future__ import annotations

import json
import threading

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from observability.otlp_receiver import OtlpReceiver
from tests.e2e.support.system import separate, stub
from tests.e2e.support.tracing import tracing_env

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
OTHER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PROMPT = list(range(1, 41))

pytestmark = pytest.mark.slow

WORKER = ["--model", "simulated", "--simulated-step-ms", "3", "--log-format", "json"]
SCHEDULER = ["--log-format", "json"]


def generate(s, rid, prompt, max_new, traceparent=None, **sampling):
    md = [("traceparent", traceparent)] if traceparent else None
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sampling),
    )
    (out,) = list(s.Generate(req, metadata=md))
    return out.complete


def json_lines(path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
    return [json.loads(ln) for ln in lines]


def test_one_trace_across_scheduler_and_worker(tmp_path):
    receiver = OtlpReceiver().start()
    try:
        with separate(tmp_path, WORKER, SCHEDULER, env=tracing_env(receiver)) as address:
            s = stub(address)
            first = generate(
                s,
                "r1",
                PROMPT,
                6,
                f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
                temperature=0.7,
                top_p=0.9,
            )
            # the same prompt again: served from the prefix cache
            second = generate(s, "r2", PROMPT[:32] + [50, 51, 52], 4, None)
            # two requests decoding together: a step span links both
            threads = [
                threading.Thread(
                    target=generate,
                    args=(
                        s,
                        f"pair{i}",
                        [90 + i] * 20,
                        40,
                        f"00-{OTHER_TRACE[:-1]}{i}-{CALLER_SPAN}-01",
                    ),
                )
                for i in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(first.output_ids) == 6 and len(second.output_ids) == 4
        spans = receiver.wait_for(
            lambda got: {"Generate", "finish", "radixserve.worker.step"} <= {x.name for x in got}
        )
    finally:
        receiver.stop()

    ours = [x for x in spans if x.trace_id == CALLER_TRACE]
    assert {x.service for x in ours} == {"radixserve-scheduler", "radixserve-worker"}
    (gen,) = [x for x in ours if x.name == "Generate"]
    assert gen.parent_span_id == CALLER_SPAN  # continues the caller's span
    by_name = {}
    for x in ours:
        by_name.setdefault(x.name, []).append(x)
    for name in ("queue", "prefill", "decode", "finish", "radixserve.worker.step"):
        assert by_name.get(name), f"no {name} span in the request's trace"
        for x in by_name[name]:
            assert x.parent_span_id == gen.span_id, name
    steps = by_name["radixserve.worker.step"]
    assert all((CALLER_TRACE, gen.span_id) in x.links for x in steps)
    assert len(steps) >= 6  # the prefill and the decode steps of its 6 tokens
    assert {x.attributes["radixserve.forward_mode"] for x in steps} >= {"prefill", "decode"}
    assert all(x.attributes["radixserve.batch_size"] >= 1 for x in steps)
    assert all(x.attributes["radixserve.forward_ms"] > 0 for x in steps)

    a = gen.attributes
    assert a["gen_ai.request.model"] == "simulated"
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["radixserve.cached_tokens"] == 0
    assert 0 < a["radixserve.time_to_first_token_s"] < (gen.end_ns - gen.start_ns) / 1e9
    (prefill,) = by_name["prefill"]
    assert prefill.attributes["radixserve.prompt_tokens"] == len(PROMPT)
    assert prefill.attributes["radixserve.computed_tokens"] == len(PROMPT)
    (finish,) = by_name["finish"]
    assert finish.attributes["gen_ai.usage.output_tokens"] == 6
    # children sit inside their parent
    for x in ours:
        if x.parent_span_id == gen.span_id:
            assert gen.start_ns <= x.start_ns <= x.end_ns <= gen.end_ns + 5_000_000, x.name

    # the second request has no caller context: a root span, with its cache hit
    (gen2,) = [
        x
        for x in spans
        if x.name == "Generate" and x.attributes.get("radixserve.request_id") == "r2"
    ]
    assert gen2.parent_span_id == "" and gen2.trace_id != CALLER_TRACE
    assert gen2.attributes["radixserve.cached_tokens"] == 32

    # the pair decoded together: some step links both Generate spans
    pair_gens = {
        x.span_id for x in spans if x.name == "Generate" and x.trace_id[:-1] == OTHER_TRACE[:-1]
    }
    assert len(pair_gens) == 2
    assert any(
        pair_gens <= {span for _, span in x.links}
        for x in spans
        if x.name == "radixserve.worker.step"
    )

    # JSON logs: every request line names its request and trace
    lines = json_lines(tmp_path / "scheduler.log")
    done = {ln["request_id"]: ln for ln in lines if ln.get("event") == "request finished"}
    assert done["r1"]["trace_id"] == CALLER_TRACE
    assert done["r2"]["trace_id"] == gen2.trace_id
    assert all("timestamp" in ln and "level" in ln for ln in lines)
    json_lines(tmp_path / "worker.log")  # parses


def test_http_protobuf_exporter(tmp_path):
    receiver = OtlpReceiver(protocol="http/protobuf").start()
    try:
        with separate(tmp_path, WORKER, SCHEDULER, env=tracing_env(receiver)) as address:
            generate(stub(address), "h1", PROMPT, 3, f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
        spans = receiver.wait_for(
            lambda got: {"Generate", "radixserve.worker.step"} <= {x.name for x in got}
        )
    finally:
        receiver.stop()
    assert {x.trace_id for x in spans} == {CALLER_TRACE}
    assert {x.service for x in spans} == {"radixserve-scheduler", "radixserve-worker"}


def test_sampler_off_exports_nothing_and_logs_keep_the_callers_trace(tmp_path):
    receiver = OtlpReceiver().start()
    try:
        env = tracing_env(receiver, OTEL_TRACES_SAMPLER="always_off")
        with separate(tmp_path, WORKER, SCHEDULER, env=env) as address:
            generate(stub(address), "off1", PROMPT, 3, f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
    finally:
        receiver.stop()
    assert receiver.spans() == []
    done = [
        ln for ln in json_lines(tmp_path / "scheduler.log") if ln.get("event") == "request finished"
    ]
    assert [(ln["request_id"], ln["trace_id"]) for ln in done] == [("off1", CALLER_TRACE)]


def test_generate_span_names_the_lora_adapter(tmp_path):
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    receiver = OtlpReceiver().start()
    try:
        scheduler = [*SCHEDULER, "--lora-paths", f"sql={adapter}"]
        with separate(tmp_path, WORKER, scheduler, env=tracing_env(receiver)) as address:
            s = stub(address)
            req = pb.GenerateRequest(
                request_id="with-lora",
                tokenized=pb.TokenizedInput(input_ids=PROMPT),
                sampling_params=pb.SamplingParams(max_new_tokens=3, ignore_eos=True),
                lora_id="sql",
            )
            md = [("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")]
            (out,) = list(s.Generate(req, metadata=md))
            assert len(out.complete.output_ids) == 3
        spans = receiver.wait_for(lambda got: "Generate" in {x.name for x in got})
    finally:
        receiver.stop()
    (gen,) = [x for x in spans if x.name == "Generate" and x.trace_id == CALLER_TRACE]
    assert gen.attributes["radixserve.lora_id"] == "sql"
