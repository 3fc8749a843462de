from __future__ import annotations

import pytest

from observability import tracing


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_when_configured(env, on):
    assert tracing.configured(env) is on


def test_protocol_defaults_to_grpc_and_refuses_unknown_ones():
    assert tracing.protocol({}) == "grpc"
    assert tracing.protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
    with pytest.raises(SystemExit, match="http/json"):
        tracing.protocol(env)


def test_unconfigured_tracing_sets_nothing_up():
    assert tracing.setup_tracing("x", env={}) is False
    assert not tracing.enabled() and tracing.current_trace_id() == ""


def test_traceparent_round_trip(span_exporter):
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = tracing.tracer().start_span("child", context=tracing.context_from_traceparent(tp))
    got, _ = tracing.traceparent_of(span)
    span.end()
    assert got.startswith("00-0af7651916cd43dd8448eb211c80319c-") and got.endswith("-01")
    assert tracing.trace_id_of_traceparent(tp) == "0af7651916cd43dd8448eb211c80319c"
    assert tracing.trace_id_of_traceparent("garbage") == ""
    (finished,) = span_exporter.get_finished_spans()
    assert format(finished.parent.span_id, "016x") == "b7ad6b7169203331"
