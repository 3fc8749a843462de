"""The core process's spans of each traced request, under its Generate span.

- ``queue``: arrival in the core (or a retraction) -> admitted;
- ``prefill``: one per chunk, plan sent -> result back, with prompt, cached
  and computed token counts;
- ``decode``: first token -> finish, with an event per retraction or
  preemption;
- ``finish``: the reason and the usage.

Spans are made when their end is known, with the recorded start times, so
nothing is held open. Only requests whose Generate span is sampled are
tracked; with tracing off this module is never used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from observability import tracing
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.request import Request


@dataclass(slots=True)
class _Traced:
    req: Request
    parent: Any  # the Generate span's context
    queued_ns: int
    in_queue: bool = True
    chunks: int = 0
    decode_ns: int | None = None
    events: list[tuple[str, int]] = field(default_factory=list)


class RequestTracer:
    """Reads the plans in flight the scheduler keeps (a chunk's span starts
    at its plan's ``sent_ns``); holds nothing per step itself."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Traced] = {}

    def submitted(self, req: Request) -> None:
        """Track ``req`` if its Generate span (``req.trace_context``) is sampled."""
        from opentelemetry.trace import get_current_span

        traceparent, tracestate = req.trace_context
        req.trace_id = tracing.trace_id_of_traceparent(traceparent)
        ctx = tracing.context_from_traceparent(traceparent, tracestate)
        span_ctx = get_current_span(ctx).get_span_context()
        if span_ctx.is_valid and span_ctx.trace_flags.sampled:
            self._reqs[req.rid] = _Traced(req, ctx, time.time_ns())

    def planned(self, plan: StepPlan) -> None:
        """``plan`` was sent (at ``plan.sent_ns``): a traced request it
        prefills leaves the queue."""
        reqs = self._reqs
        if not reqs:
            return
        for e in plan.extends:
            t = reqs.get(e.req.rid)
            if t is not None and e.drafts is None and t.in_queue:
                self._queue_span(t, plan.sent_ns)

    def result(self, plan: StepPlan) -> None:
        """``plan``'s result is back: a span for each traced prefill chunk."""
        reqs = self._reqs
        if not reqs:
            return
        now = 0
        for e in plan.extends:
            t = reqs.get(e.req.rid)
            if t is None or e.drafts is not None or t.req is not e.req:
                continue
            now = now or time.time_ns()
            req = t.req
            span = tracing.tracer().start_span(
                "prefill",
                context=t.parent,
                start_time=plan.sent_ns,
                attributes={
                    "radixserve.step_id": plan.step_id,
                    "radixserve.chunk_index": t.chunks,
                    "radixserve.prompt_tokens": len(req.prompt_ids),
                    "radixserve.cached_tokens": req.cached_tokens,
                    "radixserve.computed_tokens": len(e.input_ids or ()),
                    "radixserve.start_position": e.start_pos,
                    "radixserve.last_chunk": e.sample,
                    "radixserve.resumed": bool(req.retractions or req.preemptions),
                },
            )
            span.end(end_time=now)
            t.chunks += 1
            if e.sample and t.decode_ns is None:
                t.decode_ns = now

    def requeued(self, req: Request, kind: str) -> None:
        t = self._reqs.get(req.rid)
        if t is None:
            return
        now = time.time_ns()
        t.events.append((kind, now))
        t.in_queue, t.queued_ns = True, now

    def finished(self, req: Request) -> None:
        t = self._reqs.pop(req.rid, None)
        if t is None:
            return
        now = time.time_ns()
        tracer = tracing.tracer()
        if t.in_queue:
            self._queue_span(t, now)
        events = t.events
        if t.decode_ns is not None:
            span = tracer.start_span("decode", context=t.parent, start_time=t.decode_ns)
            for name, at in events:
                span.add_event(name, timestamp=at)
            span.set_attribute("radixserve.output_tokens", len(req.output_ids))
            span.set_attribute("radixserve.spec_draft_tokens", req.spec_draft_tokens)
            span.set_attribute("radixserve.spec_accepted_tokens", req.spec_accepted_tokens)
            span.end(end_time=now)
            events = []
        reason = req.finish_reason.kind if req.finish_reason is not None else "abort"
        span = tracer.start_span(
            "finish",
            context=t.parent,
            start_time=now,
            attributes={
                "radixserve.finish_reason": reason,
                "gen_ai.response.finish_reasons": [reason],
                "gen_ai.usage.input_tokens": len(req.prompt_ids),
                "gen_ai.usage.output_tokens": len(req.output_ids),
                "radixserve.cached_tokens": req.cached_tokens,
                "radixserve.retractions": req.retractions,
                "radixserve.preemptions": req.preemptions,
            },
        )
        for name, at in events:  # requeued before its first token
            span.add_event(name, timestamp=at)
        span.end(end_time=now)

    def _queue_span(self, t: _Traced, now: int) -> None:
        span = tracing.tracer().start_span(
            "queue",
            context=t.parent,
            start_time=t.queued_ns,
            attributes={"radixserve.requeued": bool(t.events)},
        )
        span.end(end_time=now)
        t.in_queue = False
