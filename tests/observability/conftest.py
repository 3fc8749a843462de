from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from observability import tracing


@pytest.fixture
def span_exporter():
    """Tracing on in this process, spans kept in memory (exported one by one)."""
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("radixserve-test", env={}, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()
