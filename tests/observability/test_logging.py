from __future__ import annotations

import json

import pytest
import structlog

from observability import tracing
from observability.logging_setup import configure_logging


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    structlog.reset_defaults()


def test_json_lines_carry_bound_ids_and_the_current_spans_trace(capsys, span_exporter):
    configure_logging("info", "json")
    log = structlog.get_logger("t").bind(request_id="r1", trace_id="abc")
    log.info("request finished", output_tokens=3)
    log.debug("hidden at info")
    span = tracing.tracer().start_span("s")
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=True):
        structlog.get_logger("t").warning("inside a span")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["event"] for x in lines] == ["request finished", "inside a span"]
    first, second = lines
    assert (first["request_id"], first["trace_id"], first["level"]) == ("r1", "abc", "info")
    assert "timestamp" in first and first["output_tokens"] == 3
    assert second["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_console_format_and_bad_settings(capsys):
    configure_logging("warning", "console")
    structlog.get_logger("t").warning("readable", request_id="r2")
    err = capsys.readouterr().err
    assert "readable" in err and "r2" in err and not err.lstrip().startswith("{")
    with pytest.raises(SystemExit, match="log level"):
        configure_logging("loud")
    with pytest.raises(SystemExit, match="log format"):
        configure_logging("info", "xml")
