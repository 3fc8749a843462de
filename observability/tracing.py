"""OpenTelemetry tracing set-up for a radixserve process.

Configured by the standard variables only: tracing is on when an OTLP
endpoint is given (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or ``OTEL_TRACES_EXPORTER`` names an
exporter (``otlp`` or ``console``), and off when ``OTEL_SDK_DISABLED=true``
or ``OTEL_TRACES_EXPORTER=none``. The protocol comes from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
(``grpc``, the default, or ``http/protobuf``); endpoint, headers,
certificates and timeouts are read by the exporter itself, the sampler from
``OTEL_TRACES_SAMPLER`` / ``_ARG``, the service name from
``OTEL_SERVICE_NAME`` (default: the service's own), the batch processor's
settings from ``OTEL_BSP_*``.

When tracing is off nothing from the SDK is imported and ``enabled()`` is
False: callers skip their tracing work entirely.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

_provider: Any = None  # the process's TracerProvider once set up
_tracer: Any = None
_before_shutdown: list[Callable[[], None]] = []

DEFAULT_MAX_LINKS = 4096  # a worker step links every request in its batch


def configured(env: Mapping[str, str] = os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter in ("otlp", "console"):
        return True
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def protocol(env: Mapping[str, str] = os.environ) -> str:
    value = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if value not in ("grpc", "http/protobuf"):
        raise SystemExit(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r} is not supported (grpc or http/protobuf)"
        )
    return value


def setup_tracing(
    service_name: str, env: Mapping[str, str] = os.environ, exporter: Any = None
) -> bool:
    """Install this process's tracer provider if tracing is configured.
    ``exporter`` (tests): export there, span by span, whatever the environment says."""
    global _provider, _tracer
    if _provider is not None:
        return True
    if exporter is None and not configured(env):
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    processor = SimpleSpanProcessor if exporter is not None else BatchSpanProcessor
    if exporter is None:
        exporter = make_exporter(env)
    links = None if env.get("OTEL_SPAN_LINK_COUNT_LIMIT") else DEFAULT_MAX_LINKS
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        span_limits=SpanLimits(max_links=links),
    )
    provider.add_span_processor(processor(exporter))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)  # the global one can be set once per process
    _provider = provider
    _tracer = provider.get_tracer("radixserve")
    return True


def make_exporter(env: Mapping[str, str] = os.environ) -> Any:
    """The span exporter the environment asks for (OTLP gRPC or HTTP, or console)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return ConsoleSpanExporter()
    if protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def enabled() -> bool:
    return _provider is not None


def tracer() -> Any:
    return _tracer


def before_shutdown(callback: Callable[[], None]) -> None:
    """Run ``callback`` (e.g. drain a thread that makes spans) before the flush."""
    _before_shutdown.append(callback)


def shutdown_tracing() -> None:
    """Flush the batch processor and stop the exporter (a clean stop loses nothing)."""
    global _provider, _tracer
    while _before_shutdown:
        _before_shutdown.pop()()
    if _provider is not None:
        _provider.shutdown()
        _provider = _tracer = None


def current_trace_id() -> str:
    if _provider is None:
        return ""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def context_from_traceparent(traceparent: str, tracestate: str = "") -> Any:
    """An OTel Context whose current span is the remote span a traceparent names."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent_of(span: Any) -> tuple[str, str]:
    """(traceparent, tracestate) of a span, to carry across a process boundary."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def trace_id_of_traceparent(traceparent: str) -> str:
    """The trace id field of a W3C traceparent ('' when malformed)."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""
