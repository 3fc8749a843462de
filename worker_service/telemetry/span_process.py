"""The worker's span process: turns the steps its worker pipes over into
``radixserve.worker.step`` spans (see step_tracing.py) and exports them.

Reads pickled lists from stdin, written only by its own parent worker, of
``(plan bytes, start ns, end ns, forward ms)`` per step and ``"reset"`` when
a new Execute stream starts. Flushes and exits at end of input.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any

import structlog

from common import lifeline
from observability import tracing
from observability.logging_setup import configure_logging
from protos import worker_pb2 as pb
from worker_service.telemetry.span_encoding import (
    SPAN_NAME,
    SpanBatcher,
    StepSpanEncoder,
    TracedSlots,
    install_passthrough,
    step_attributes,
)
from worker_service.telemetry.step_tracing import RESET

logger = structlog.get_logger(__name__)

SERVICE_NAME = "radixserve-worker"  # OTEL_SERVICE_NAME overrides it


class StepSpans:
    """The SDK path (console exporter, or an SDK the fast path cannot feed)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # (parent context, link) of each traced request
        self.traced: TracedSlots[tuple[Any, Any]] = TracedSlots(self._context_of)

    @staticmethod
    def _context_of(traceparent: str, tracestate: str) -> tuple[Any, Any] | None:
        from opentelemetry.trace import Link, get_current_span

        ctx = tracing.context_from_traceparent(traceparent, tracestate)
        span_ctx = get_current_span(ctx).get_span_context()
        if span_ctx.is_valid and span_ctx.trace_flags.sampled:
            return ctx, Link(span_ctx)
        return None

    def record(self, plan: pb.StepPlan, start_ns: int, end_ns: int, forward_ms: float) -> None:
        from opentelemetry.trace import SpanKind

        members = self.traced.update(plan)
        if not members:
            return
        span = tracing.tracer().start_span(
            SPAN_NAME,
            context=members[0][0],
            kind=SpanKind.INTERNAL,
            links=[link for _, link in members],
            start_time=start_ns,
            attributes=step_attributes(plan, len(members), forward_ms, self.rank),
        )
        span.end(end_time=end_ns)


def _fast_path(rank: int, env) -> tuple[StepSpanEncoder, SpanBatcher] | None:
    """Encode step spans straight to OTLP unless the exporter is not OTLP or
    this SDK cannot take ready requests (then the SDK path makes them)."""
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return None
    if not install_passthrough():
        logger.warning("this OpenTelemetry SDK takes no ready requests: slower step spans")
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    sampler = TracerProvider().sampler if env.get("OTEL_TRACES_SAMPLER") else None
    resource = Resource.create({"service.name": SERVICE_NAME}).attributes
    return StepSpanEncoder(rank, sampler), SpanBatcher(tracing.make_exporter(env), resource, env)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its worker decides when it stops
    # A worker that ends closes this one's input (a flush, then exit), but
    # another process may hold the pipe's end too (a child forked from the
    # worker): die with the worker whatever else holds it.
    lifeline.die_with_parent()
    configure_logging("warning")
    rank = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    fast = _fast_path(rank, os.environ)
    slow = None
    if fast is None:
        tracing.setup_tracing(SERVICE_NAME)
        slow = StepSpans(rank)
    stdin = sys.stdin.buffer
    try:
        while True:
            try:
                batch = pickle.load(stdin)
            except EOFError:
                break
            for item in batch:
                if item == RESET:
                    (fast[0] if fast is not None else slow).traced.clear()
                    continue
                data, start_ns, end_ns, forward_ms = item
                try:
                    plan = pb.StepPlan.FromString(data)
                    if fast is not None:
                        span = fast[0].span(plan, start_ns, end_ns, forward_ms)
                        if span is not None:
                            fast[1].add(span)
                    else:
                        slow.record(plan, start_ns, end_ns, forward_ms)
                except Exception as e:  # one bad step must not end tracing
                    logger.warning("step span failed", error=str(e))
    finally:
        if fast is not None:
            fast[1].shutdown()
        tracing.shutdown_tracing()


if __name__ == "__main__":
    main()
