"""The core's request spans, driven as the engine drives them: a scheduler
with a page pool too small for its load (so requests are retracted) and
chunked prefill, against the simulated worker."""

from __future__ import annotations

import time

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.engine.request_tracing import RequestTracer
from scheduler_service.testing.simulated_worker import expected_output
from tests.scheduler_service.core.support.sim_driver import check_drained, make_pair

V = 64
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GENERATE_SPAN = "00f067aa0ba902b7"


class Driver:
    """Scheduler + simulated worker + RequestTracer, wired as the engine wires them."""

    def __init__(self, config: SchedulerConfig, num_pages: int) -> None:
        self.sched, self.worker = make_pair(config, num_pages, V)
        self.tracer = RequestTracer()
        self.sched.on_requeue = self.tracer.requeued

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            r.trace_context = (f"00-{CALLER_TRACE}-{GENERATE_SPAN}-01", "")
            self.sched.add_request(r)
            self.tracer.submitted(r)

    def until_idle(self) -> None:
        sched, tracer = self.sched, self.tracer
        while not sched.is_idle():
            plan = sched.step()
            sched.check_integrity()
            if plan is not None:
                plan.sent_ns = time.time_ns()
                tracer.planned(plan)
                result = self.worker.execute(plan)
                tracer.result(plan)
                sched.update(result)
                sched.check_integrity()
            for d in sched.drain():
                if d.finished:
                    tracer.finished(d.req)
        check_drained(sched, self.worker)


def run(reqs: list[Request], config: SchedulerConfig, num_pages: int) -> None:
    driver = Driver(config, num_pages)
    driver.add(*reqs)
    driver.until_idle()


def by_name(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def test_queue_chunks_decode_and_finish_spans_with_retractions(span_exporter):
    reqs = [
        Request(f"r{i}", list(range(10 * i + 1, 10 * i + 11)), SamplingParams(max_new_tokens=30))
        for i in range(4)
    ]
    config = SchedulerConfig(
        page_size=1, init_new_token_ratio=0.01, chunked_prefill_size=4, max_prefill_tokens=64
    )
    run(reqs, config, 60)
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 30, V)
        assert r.trace_id == CALLER_TRACE
    assert any(r.retractions for r in reqs), "the pool was meant to force a retraction"
    spans = span_exporter.get_finished_spans()
    for s in spans:
        assert format(s.context.trace_id, "032x") == CALLER_TRACE
        assert format(s.parent.span_id, "016x") == GENERATE_SPAN
    finishes = by_name(spans, "finish")
    assert len(finishes) == 4 and len(by_name(spans, "decode")) == 4
    for f in finishes:
        a = f.attributes
        assert a["radixserve.finish_reason"] == "length"
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        assert a["gen_ai.usage.input_tokens"] == 10 and a["gen_ai.usage.output_tokens"] == 30
    chunks = by_name(spans, "prefill")
    first = [c for c in chunks if not c.attributes["radixserve.resumed"]]
    # 10-token prompts in chunks of at most 4: 4 + 4 + 2 computed for each request
    assert sorted(c.attributes["radixserve.computed_tokens"] for c in first) == sorted(
        [4, 4, 2] * 4
    )
    assert all(c.attributes["radixserve.prompt_tokens"] == 10 for c in chunks)
    assert all(c.end_time >= c.start_time for c in spans)
    events = [e.name for s in spans for e in s.events]
    retracted = sum(r.retractions for r in reqs)
    assert events.count("retraction") == retracted
    # a retracted request waits again: one more queue span and a resumed prefill
    assert len(by_name(spans, "queue")) == 4 + retracted
    assert any(c.attributes["radixserve.resumed"] for c in chunks)


def test_cached_prefix_is_reported(span_exporter):
    prompt = list(range(1, 33))
    driver = Driver(SchedulerConfig(page_size=4), 64)
    driver.add(Request("a", prompt, SamplingParams(max_new_tokens=2)))
    driver.until_idle()
    driver.add(Request("b", prompt[:28] + [40, 41, 42, 43], SamplingParams(max_new_tokens=2)))
    driver.until_idle()
    spans = span_exporter.get_finished_spans()
    a, b = by_name(spans, "prefill")
    assert a.attributes["radixserve.cached_tokens"] == 0
    assert a.attributes["radixserve.computed_tokens"] == 32
    assert b.attributes["radixserve.cached_tokens"] == 28
    assert b.attributes["radixserve.computed_tokens"] == 4
    assert b.attributes["radixserve.start_position"] == 28
    fa, fb = by_name(spans, "finish")
    assert (
        fa.attributes["radixserve.cached_tokens"],
        fb.attributes["radixserve.cached_tokens"],
    ) == (0, 28)


def test_untraced_and_unsampled_requests_make_no_spans(span_exporter):
    driver = Driver(SchedulerConfig(page_size=4), 64)
    driver.sched.add_request(Request("plain", [1, 2, 3], SamplingParams(max_new_tokens=2)))
    r = Request("unsampled", [4, 5, 6], SamplingParams(max_new_tokens=2))
    r.trace_context = (f"00-{CALLER_TRACE}-{GENERATE_SPAN}-00", "")
    driver.sched.add_request(r)
    driver.tracer.submitted(r)
    driver.until_idle()
    assert span_exporter.get_finished_spans() == ()
    assert r.trace_id == CALLER_TRACE  # log lines still name the caller's trace
