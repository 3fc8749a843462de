"""structlog for a radixserve process: JSON lines when stderr is not a TTY
(or with --log-format json), readable columns on a TTY, at the level asked for.

Request lines carry ``request_id`` and ``trace_id``: code that handles one
request binds them (``structlog.contextvars.bound_contextvars``) or passes
them; lines logged inside an active OpenTelemetry span get its trace id.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOG_FORMATS = ("auto", "json", "console")


def _add_trace_id(_logger: Any, _name: str, event: dict) -> dict:
    """The current span's trace id, for lines logged inside one."""
    if "trace_id" not in event:
        from observability.tracing import current_trace_id

        trace_id = current_trace_id()
        if trace_id:
            event["trace_id"] = trace_id
    return event


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise SystemExit(f"unknown log level {level!r} (debug, info, warning, error)")
    if fmt not in LOG_FORMATS:
        raise SystemExit(f"unknown log format {fmt!r} (one of {', '.join(LOG_FORMATS)})")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            _add_trace_id,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
