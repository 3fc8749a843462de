"""The environment that points a radixserve process's OpenTelemetry exporter at
a test's OTLP receiver."""

from __future__ import annotations

from observability.otlp_receiver import OtlpReceiver


def tracing_env(receiver: OtlpReceiver, **extra: str) -> dict:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "600000",  # only the shutdown flush exports
        "OTEL_SERVICE_NAME": None,
        "OTEL_TRACES_SAMPLER": None,
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_SDK_DISABLED": None,
        **extra,
    }
