"""What one Generate call reports: its span, its metrics and its log line.

The span ``Generate`` continues the caller's W3C trace context (gRPC
metadata ``traceparent``/``tracestate``) and carries the OpenTelemetry GenAI
attributes; its context goes to the core process (which adds the queue,
prefill, decode and finish spans under it) and on to the workers (whose step
spans link to it). Log lines of the call carry its request id and trace id,
the trace id being the caller's even when this process does not trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import structlog

from observability import tracing
from scheduler_service import ipc
from scheduler_service.api.convert.public import GenerateCall
from scheduler_service.api.metrics import SchedulerMetrics

logger = structlog.get_logger(__name__)

RPC_SERVICE = "sglang.grpc.scheduler.SglangScheduler"


def _metadata(pairs: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if key in ("traceparent", "tracestate") and isinstance(value, str):
            out[key] = value
    return out


class _Sample:
    __slots__ = ("cached", "first_at", "last_at", "tokens")

    def __init__(self) -> None:
        self.first_at = 0.0
        self.last_at = 0.0
        self.tokens = 0
        self.cached = 0  # the core's latest count (a worker loss can lower it)


class CallObserver:
    def __init__(
        self,
        metrics: SchedulerMetrics | None,
        model_name: str,
        request_id: str,
        metadata: Iterable[tuple[str, Any]] | None,
    ) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.started = time.perf_counter()
        self.request_id = request_id
        self.samples: dict[str, _Sample] = {}
        self.g: GenerateCall | None = None
        self.finish_reasons: list[str] = []
        self.cached_tokens = 0
        self.ttft_s: float | None = None
        # set when the call is aborted from inside the response loop
        self.abort_code: str | None = None
        self.abort_message = ""
        md = _metadata(metadata)
        self.trace_id = tracing.trace_id_of_traceparent(md.get("traceparent", ""))
        self.span: Any = None
        if tracing.enabled():
            from opentelemetry.trace import SpanKind

            parent = (
                tracing.context_from_traceparent(md["traceparent"], md.get("tracestate", ""))
                if "traceparent" in md
                else None
            )
            self.span = tracing.tracer().start_span(
                "Generate",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": RPC_SERVICE,
                    "rpc.method": "Generate",
                    "gen_ai.operation.name": "text_completion",
                    "gen_ai.request.model": model_name,
                },
            )
            ctx = self.span.get_span_context()
            if ctx.is_valid:
                self.trace_id = format(ctx.trace_id, "032x")
        # every line about the call carries its request id and trace id
        self.log = logger.bind(request_id=request_id, trace_id=self.trace_id)

    # --------------------------------------------------------------- start
    def accepted(self, g: GenerateCall) -> tuple[str, str] | None:
        """The call passed validation; returns the Generate span's context
        when it is recorded, for the samples to carry to the core
        (``Submission.trace_context``)."""
        self.g = g
        self.request_id = g.rid
        self.log = logger.bind(request_id=g.rid, trace_id=self.trace_id)
        # keyed by the samples' internal rids, which the CoreClient gives
        # them at submit (after this): filled as their outputs come
        self.samples = {}
        if g.lora_id is not None:
            self.log = self.log.bind(lora_id=g.lora_id)
            if self.metrics is not None:
                self.metrics.lora_request(g.lora_id, len(g.samples))
        span = self.span
        if span is None or not span.is_recording():
            return None
        sp = g.samples[0].sampling
        span.set_attributes(
            {
                "gen_ai.request.max_tokens": sp.max_new_tokens,
                "gen_ai.request.temperature": sp.temperature,
                "gen_ai.request.top_p": sp.top_p,
                "gen_ai.request.top_k": sp.top_k,
                "gen_ai.request.choice.count": len(g.samples),
                "gen_ai.response.id": g.rid,
                "radixserve.request_id": g.rid,
                "radixserve.stream": g.stream,
            }
        )
        if g.lora_id is not None:
            span.set_attribute("radixserve.lora_id", g.lora_id)
        return tracing.traceparent_of(span)

    # -------------------------------------------------------------- deltas
    def delta(self, d: ipc.DeltaOut, now: float) -> None:
        s = self.samples.get(d.rid)
        if s is None:
            if self.g is None:
                return
            s = self.samples[d.rid] = _Sample()
        if d.token_ids:
            self._tokens(s, len(d.token_ids), d.cached_tokens, now)
        if d.finish is not None:
            self._finished(s, d.finish, d.cached_tokens, now)

    def tokens(self, rid: str, n: int, cached: int, now: float) -> None:
        """``n`` tokens of sample ``rid`` reached the call at ``now`` (a
        delta of n tokens; token news is counted once per batch)."""
        s = self.samples.get(rid)
        if s is None:
            if self.g is None:
                return
            s = self.samples[rid] = _Sample()
        self._tokens(s, n, cached, now)

    def _tokens(self, s: _Sample, n: int, cached: int, now: float) -> None:
        m = self.metrics
        if s.tokens == 0:
            s.first_at = now
            ttft = now - self.started
            if self.ttft_s is None:
                self.ttft_s = ttft
            if m is not None:
                m.ttft.observe(ttft)
        elif m is not None:
            m.itl.observe_many((now - s.last_at) / n, n)
        s.tokens += n
        s.last_at = now
        s.cached = cached
        if m is not None:
            m.generation_tokens += n
            if self.g is not None and self.g.lora_id is not None:
                m.lora_tokens(self.g.lora_id, n)

    def _finished(self, s: _Sample, finish: ipc.Finish, cached: int, now: float) -> None:
        self.finish_reasons.append(finish.kind)
        s.cached = cached
        m = self.metrics
        if m is not None:
            m.finished[finish.kind] = m.finished.get(finish.kind, 0) + 1
            if s.tokens:
                m.e2e.observe(now - self.started)

    def failed(self, code: str, message: str) -> None:
        self.abort_code, self.abort_message = code, message

    # ---------------------------------------------------------------- end
    def end(self, code: str | None = None, message: str = "") -> None:
        """The call is over: ``code`` is the gRPC status name when it failed."""
        e2e = time.perf_counter() - self.started
        output = sum(s.tokens for s in self.samples.values())
        prompt = self.g.prompt_len if self.g else 0
        # A sample's prompt and cached tokens count once its call is over,
        # with the core's final count: the number the response carried.
        self.cached_tokens = max((s.cached for s in self.samples.values()), default=0)
        m = self.metrics
        if m is not None:
            for s in self.samples.values():
                if s.tokens:
                    m.prompt_tokens += prompt
                    m.cached_tokens += s.cached
            if code is not None:
                m.error(code)
        span = self.span
        if span is not None:
            if span.is_recording():
                attrs: dict[str, Any] = {
                    "gen_ai.usage.input_tokens": prompt,
                    "gen_ai.usage.output_tokens": output,
                    "gen_ai.response.finish_reasons": self.finish_reasons,
                    "radixserve.cached_tokens": self.cached_tokens,
                }
                if self.ttft_s is not None:
                    attrs["radixserve.time_to_first_token_s"] = self.ttft_s
                if code is not None:
                    from opentelemetry.trace import Status, StatusCode

                    attrs["rpc.grpc.status_code_name"] = code
                    span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
                span.set_attributes(attrs)
            span.end()
        fields = {
            "prompt_tokens": prompt,
            "output_tokens": output,
            "cached_tokens": self.cached_tokens,
            "finish_reasons": self.finish_reasons,
            "ttft_s": round(self.ttft_s, 4) if self.ttft_s is not None else None,
            "e2e_s": round(e2e, 4),
        }
        if code is None:
            self.log.info("request finished", **fields)
        else:
            self.log.info("request failed", code=code, error=message, **fields)
