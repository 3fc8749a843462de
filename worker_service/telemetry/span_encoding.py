"""Step spans straight to OTLP protobuf, for the worker's span process.

A step span links every traced request of its batch: hundreds of links,
hundreds of times a second. Through the SDK each link is a Python object and
then an OTLP message built field by field at export (about 1.2 ms for 256
links on the reference machine, i.e. a core's worth at 2 ms steps). Here
each request's link is encoded once, when it joins, and a step's span is
its own few fields followed by those bytes (protobuf concatenates repeated
fields), parsed once by the C implementation.

Spans are batched as the SDK's batch processor would (``OTEL_BSP_*``: delay,
queue and batch sizes) and handed to the SDK's own OTLP exporter (gRPC or
HTTP/protobuf, configured by ``OTEL_EXPORTER_OTLP_*``) as a ready request,
so endpoint, headers, TLS, compression and retries stay the SDK's.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.proto.trace.v1 import trace_pb2 as tpb

from protos import worker_pb2 as pb
from worker_service.telemetry.metrics import MODES

logger = structlog.get_logger(__name__)

SPAN_NAME = "radixserve.worker.step"
T = TypeVar("T")
# Span/link flags: sampled, and "the parent is remote" (it came over the wire).
REMOTE_SAMPLED = 0x01 | 0x100 | 0x200
# Tags of length-delimited fields: (field number << 3) | 2.
_LINKS_FIELD_TAG = b"\x6a"  # Span.links = 13
_SPANS_FIELD_TAG = b"\x12"  # ScopeSpans.spans = 2
_SCOPE_SPANS_FIELD_TAG = b"\x12"  # ResourceSpans.scope_spans = 2
_RESOURCE_SPANS_FIELD_TAG = b"\x0a"  # ExportTraceServiceRequest.resource_spans = 1


def any_value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, Sequence):
        out = AnyValue()
        out.array_value.values.extend(any_value(x) for x in v)
        return out
    return AnyValue(string_value=str(v))


def key_values(attrs: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def parse_traceparent(traceparent: str) -> tuple[bytes, bytes, bool] | None:
    """(trace id, span id, sampled) of a W3C traceparent; None when invalid."""
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    try:
        trace_id, span_id, flags = bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), parts[3]
        sampled = bool(int(flags, 16) & 1)
    except ValueError:
        return None
    if len(trace_id) != 16 or len(span_id) != 8 or not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id, sampled


def step_attributes(plan: pb.StepPlan, traced: int, forward_ms: float, rank: int) -> dict[str, Any]:
    """The attributes of a step's span (both span paths); a plan with host-tier
    copies also names how many pages it loaded and wrote back."""
    attributes = {
        "radixserve.step_id": plan.step_id,
        "radixserve.forward_mode": MODES.get(plan.mode, "unknown"),
        "radixserve.batch_size": len(plan.extends) + len(plan.decode_slots),
        "radixserve.batch_tokens": sum(len(e.input_ids) for e in plan.extends)
        + len(plan.decode_slots),
        "radixserve.prefill_requests": len(plan.extends),
        "radixserve.decode_requests": len(plan.decode_slots),
        "radixserve.traced_requests": traced,
        "radixserve.forward_ms": forward_ms,
        "radixserve.tp_rank": rank,
    }
    if plan.load_host_pages or plan.write_back_host_pages:
        attributes["radixserve.hicache_load_pages"] = len(plan.load_host_pages)
        attributes["radixserve.hicache_write_back_pages"] = len(plan.write_back_host_pages)
    return attributes


class _Traced:
    __slots__ = ("link_field", "span_id", "trace_id", "tracestate")

    def __init__(self, trace_id: bytes, span_id: bytes, tracestate: str) -> None:
        self.trace_id, self.span_id, self.tracestate = trace_id, span_id, tracestate
        link = tpb.Span.Link(
            trace_id=trace_id, span_id=span_id, trace_state=tracestate, flags=REMOTE_SAMPLED
        ).SerializeToString()
        self.link_field = _LINKS_FIELD_TAG + _varint(len(link)) + link


class EncodedSpans(list):
    """A ready OTLP request passed where the exporter expects spans (its len
    is the number of spans, for the exporter's own accounting)."""

    def __init__(self, request: ExportTraceServiceRequest, count: int) -> None:
        super().__init__([None] * count)
        self.request = request


def install_passthrough() -> bool:
    """Let the SDK's OTLP exporters send an EncodedSpans as it is.

    Both exporters encode through the name ``encode_spans`` in their module;
    it is wrapped to pass ready requests through. Returns False (and changes
    nothing) if an SDK version no longer has that name.
    """
    import importlib

    modules = []
    for name in (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ):
        module = importlib.import_module(name)
        if not callable(getattr(module, "encode_spans", None)):
            return False
        modules.append(module)
    for module in modules:
        original = module.encode_spans
        if getattr(original, "radixserve_passthrough", False):
            continue

        def encode(spans, _original=original):
            if isinstance(spans, EncodedSpans):
                return spans.request
            return _original(spans)

        encode.radixserve_passthrough = True
        module.encode_spans = encode
    return True


class TracedSlots(Generic[T]):
    """The traced requests a worker holds, by slot, kept in step with the
    plans (leaves, then joins); ``make`` turns a join's trace context into
    what a span path keeps for it (None: not traced, or not sampled)."""

    def __init__(self, make: Callable[[str, str], T | None]) -> None:
        self._make = make
        self._by_slot: dict[int, T] = {}

    def clear(self) -> None:
        self._by_slot.clear()

    def update(self, plan: pb.StepPlan) -> list[T]:
        """Apply the plan's leaves and joins; the traced requests it computes,
        in plan order."""
        by_slot = self._by_slot
        for slot in plan.leaves:
            by_slot.pop(slot, None)
        for join in plan.joins:
            by_slot.pop(join.slot, None)
            if join.trace.traceparent:
                kept = self._make(join.trace.traceparent, join.trace.tracestate)
                if kept is not None:
                    by_slot[join.slot] = kept
        if not by_slot:
            return []
        members = [by_slot[e.slot] for e in plan.extends if e.slot in by_slot]
        members.extend(by_slot[s] for s in plan.decode_slots if s in by_slot)
        return members


def _traced_of(traceparent: str, tracestate: str) -> _Traced | None:
    parsed = parse_traceparent(traceparent)
    if parsed is None or not parsed[2]:
        return None
    return _Traced(parsed[0], parsed[1], tracestate)


class StepSpanEncoder:
    """Per-slot links, and one OTLP span per step with a traced request."""

    def __init__(self, rank: int, sampler: Any = None) -> None:
        self.rank = rank
        self.sampler = sampler
        self.traced: TracedSlots[_Traced] = TracedSlots(_traced_of)
        self._rand = random.Random()

    def span(
        self, plan: pb.StepPlan, start_ns: int, end_ns: int, forward_ms: float
    ) -> bytes | None:
        """The step's span, serialized (None when no traced request is in it)."""
        members = self.traced.update(plan)
        if not members:
            return None
        parent = members[0]
        if self.sampler is not None and not self._sampled(parent):
            return None
        span_id = 0
        while not span_id:
            span_id = self._rand.getrandbits(64)
        span = tpb.Span(
            trace_id=parent.trace_id,
            span_id=span_id.to_bytes(8, "big"),
            parent_span_id=parent.span_id,
            trace_state=parent.tracestate,
            flags=REMOTE_SAMPLED,
            name=SPAN_NAME,
            kind=tpb.Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=start_ns,
            end_time_unix_nano=end_ns,
            attributes=key_values(step_attributes(plan, len(members), forward_ms, self.rank)),
        )
        return span.SerializeToString() + b"".join(m.link_field for m in members)

    def _sampled(self, parent: _Traced) -> bool:
        """The configured sampler's decision (parent-based ones follow the parent)."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace.sampling import Decision

        ctx = trace.set_span_in_context(
            trace.NonRecordingSpan(
                trace.SpanContext(
                    int.from_bytes(parent.trace_id, "big"),
                    int.from_bytes(parent.span_id, "big"),
                    is_remote=True,
                    trace_flags=trace.TraceFlags(1),
                )
            )
        )
        result = self.sampler.should_sample(ctx, int.from_bytes(parent.trace_id, "big"), SPAN_NAME)
        return result.decision is Decision.RECORD_AND_SAMPLE


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


class SpanBatcher:
    """Queues encoded spans and exports them in batches from a thread."""

    def __init__(
        self, exporter: Any, resource: Mapping[str, Any], env: Mapping[str, str] = os.environ
    ) -> None:
        self.exporter = exporter
        self.delay_s = _env_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1e3
        self.max_queue = _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = _env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self.dropped = 0
        res = PbResource(attributes=key_values(resource)).SerializeToString()
        scope = InstrumentationScope(name="radixserve").SerializeToString()
        self._resource_field = b"\x0a" + _varint(len(res)) + res  # ResourceSpans.resource
        self._scope_field = b"\x0a" + _varint(len(scope)) + scope  # ScopeSpans.scope
        self._spans: list[bytes] = []  # serialized spans
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="span-export")
        self._thread.start()

    def add(self, span: bytes) -> None:
        with self._cond:
            if len(self._spans) >= self.max_queue:
                self.dropped += 1
                return
            self._spans.append(span)
            if len(self._spans) >= self.max_batch:
                self._cond.notify()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self.exporter.shutdown()
        if self.dropped:
            logger.warning("step spans dropped: the exporter fell behind", dropped=self.dropped)

    def _run(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + self.delay_s
                while not self._closing and len(self._spans) < self.max_batch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                closing = self._closing
                batch, self._spans = self._spans, []
            while batch:
                self._export(batch[: self.max_batch])
                batch = batch[self.max_batch :]
            if closing:
                return

    def _export(self, spans: list[bytes]) -> None:
        # The request is assembled as bytes (each span a length-delimited
        # entry of ScopeSpans.spans) and parsed once, in C.
        body = b"".join(_SPANS_FIELD_TAG + _varint(len(x)) + x for x in spans)
        scope_spans = self._scope_field + body
        resource_spans = (
            self._resource_field + _SCOPE_SPANS_FIELD_TAG + _varint(len(scope_spans)) + scope_spans
        )
        request = ExportTraceServiceRequest.FromString(
            _RESOURCE_SPANS_FIELD_TAG + _varint(len(resource_spans)) + resource_spans
        )
        try:
            self.exporter.export(EncodedSpans(request, len(spans)))
        except Exception as e:  # the exporter logs its own failures; never stop
            logger.warning("span export failed", error=str(e))
