"""An abort the scheduler decides carries the status its call ends with
(FinishAbort.code, as SGLang's scheduler gives its aborts a status code);
an abort the client asked for carries none and ends as a completion."""

from __future__ import annotations

from scheduler_service.core import FinishAbort, Request, SamplingParams, SchedulerConfig
from scheduler_service.core.adapters import Adapter
from scheduler_service.core.admission.decision import unfit_head
from scheduler_service.core.kv.page_pool import PagePool
from tests.scheduler_service.core.support.sim_driver import check_drained, drive, make_pair

V = 64


def test_out_of_memory_after_retraction_ends_resource_exhausted_with_why():
    config = SchedulerConfig(vocab_size=V)
    r = Request("r", list(range(1, 10)), SamplingParams(max_new_tokens=40))
    sched, worker = make_pair(config, 20, V)
    drive(sched, worker, [(0, r)])
    check_drained(sched, worker)
    assert r.finish_reason == FinishAbort(
        "out of memory: the KV cache cannot hold this request even after retracting all others",
        "RESOURCE_EXHAUSTED",
    )


def test_a_request_first_in_line_that_cannot_fit_an_empty_pool_ends_resource_exhausted():
    pool = PagePool(4, page_size=4)
    grown = Request("grown", list(range(1, 15)))
    grown.output_ids = [1, 2, 3]  # a retracted request that grew past the pool
    head, reason = unfit_head(None, [grown], pool)
    assert head is grown
    assert reason == FinishAbort(
        "out of memory: the request needs 18 tokens of KV cache and the pool holds 16",
        "RESOURCE_EXHAUSTED",
    )


def test_the_requests_of_an_adapter_that_no_longer_loads_end_unavailable():
    config = SchedulerConfig(vocab_size=V)
    sched, worker = make_pair(config, 64, V)
    sched.register_adapter(Adapter("chat", "chat", "/adapters/chat"))
    r = Request("r", [1, 2, 3], SamplingParams(max_new_tokens=8), adapter="chat")
    sched.add_request(r)
    sched.update(worker.execute(sched.step()))
    sched.check_integrity()
    assert sched.abort_adapter_requests("chat", "adapter 'chat' is gone") == 1
    sched.check_integrity()
    assert r.finish_reason == FinishAbort("adapter 'chat' is gone", "UNAVAILABLE")
    (delta,) = [d for d in sched.drain() if d.finished]
    assert delta.req is r


def test_an_abort_the_client_asked_for_carries_no_status():
    sched, _ = make_pair(SchedulerConfig(vocab_size=V), 64, V)
    r = Request("r", [1, 2, 3])
    sched.add_request(r)
    sched.abort("r")
    sched.check_integrity()
    assert r.finish_reason == FinishAbort("aborted by the client") and r.finish_reason.code == ""
