"""The worker span process's direct OTLP encoding, exported through the
SDK's own exporters to a real receiver (gRPC and HTTP/protobuf)."""

from __future__ import annotations

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2 as tpb

from observability.otlp_receiver import OtlpReceiver
from protos import worker_pb2 as pb
from worker_service.telemetry.span_encoding import (
    SpanBatcher,
    StepSpanEncoder,
    install_passthrough,
    parse_traceparent,
)

A = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
B = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


def tp(ids, flags="01") -> str:
    return f"00-{ids[0]}-{ids[1]}-{flags}"


def test_parse_traceparent():
    assert parse_traceparent(tp(A)) == (bytes.fromhex(A[0]), bytes.fromhex(A[1]), True)
    assert parse_traceparent(tp(A, "00"))[2] is False
    for bad in ("", "00-xyz-abc-01", f"ff-{A[0]}-{A[1]}-01", f"00-{'0' * 32}-{A[1]}-01"):
        assert parse_traceparent(bad) is None


def plans() -> list[pb.StepPlan]:
    join = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    for slot, ctx in ((0, tp(A)), (1, ""), (2, tp(B)), (3, tp(B, "00"))):
        j = join.joins.add(slot=slot, rid=f"r{slot}")
        j.trace.traceparent = ctx
        join.extends.add(slot=slot, start_pos=0, input_ids=[1, 2, 3], sample=True)
    decode = pb.StepPlan(step_id=2, mode=pb.FORWARD_MODE_DECODE, leaves=[0])
    decode.decode_slots.extend([1, 2, 3])
    decode.decode_positions.extend([3, 3, 3])
    untraced = pb.StepPlan(step_id=3, mode=pb.FORWARD_MODE_DECODE, leaves=[2])
    untraced.decode_slots.extend([1, 3])
    untraced.decode_positions.extend([4, 4])
    return [join, decode, untraced]


def test_spans_link_every_traced_request_and_follow_the_first():
    enc = StepSpanEncoder(rank=1)
    spans = [enc.span(p, 10, 20, 0.5) for p in plans()]
    first, second, third = (tpb.Span.FromString(x) if x else None for x in spans)
    assert third is None  # nobody traced left in the batch
    assert first.trace_id.hex() == A[0] and first.parent_span_id.hex() == A[1]
    assert [(ln.trace_id.hex(), ln.span_id.hex()) for ln in first.links] == [A, B]
    assert second.trace_id.hex() == B[0]  # A left: B is the first traced now
    assert [ln.span_id.hex() for ln in second.links] == [B[1]]
    attrs = {kv.key: kv.value for kv in first.attributes}
    assert attrs["radixserve.batch_size"].int_value == 4
    assert attrs["radixserve.batch_tokens"].int_value == 12
    assert attrs["radixserve.forward_mode"].string_value == "prefill"
    assert attrs["radixserve.tp_rank"].int_value == 1
    assert (first.start_time_unix_nano, first.end_time_unix_nano) == (10, 20)
    assert len(first.span_id) == 8 and first.span_id != second.span_id


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_batches_go_out_through_the_sdk_exporters(protocol):
    assert install_passthrough()
    receiver = OtlpReceiver(protocol=protocol).start()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=receiver.endpoint + "/v1/traces")
        env = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
        batcher = SpanBatcher(exporter, {"service.name": "radixserve-worker"}, env)
        enc = StepSpanEncoder(rank=0)
        for p in plans():
            span = enc.span(p, 10, 20, 0.5)
            if span is not None:
                batcher.add(span)
        batcher.shutdown()
        got = receiver.wait_for(lambda s: len(s) == 2, timeout_s=10)
    finally:
        receiver.stop()
    assert {s.service for s in got} == {"radixserve-worker"}
    assert sorted(len(s.links) for s in got) == [1, 2]
    assert all(s.name == "radixserve.worker.step" for s in got)


def test_the_sdk_path_makes_the_same_spans(span_exporter):
    from worker_service.telemetry.span_process import StepSpans

    sdk = StepSpans(rank=1)
    for p in plans():
        sdk.record(p, 10, 20, 0.5)
    first, second = span_exporter.get_finished_spans()
    assert format(first.context.trace_id, "032x") == A[0]
    assert format(first.parent.span_id, "016x") == A[1]
    assert [format(ln.context.span_id, "016x") for ln in first.links] == [A[1], B[1]]
    assert [format(ln.context.span_id, "016x") for ln in second.links] == [B[1]]
    assert first.attributes["radixserve.batch_tokens"] == 12
