"""Prefill/decode disaggregation in the core (core/disagg/): each state and
each failure path of both roles, one at a time. The random mixes are in
test_disagg_properties.py."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_service.core import (
    FinishAbort,
    InvalidRequestError,
    Place,
    Request,
    SamplingParams,
    SchedulerConfig,
)
from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.disagg.transfer import TRANSFER_FAILED
from scheduler_service.testing.simulated_worker import expected_output
from tests.scheduler_service.core.support.pd_driver import (
    Clock,
    RoomPlan,
    check_pd,
    drive_pd,
    pd_units,
)
from tests.scheduler_service.core.support.sim_driver import drive, make_pair

VOCAB = 40
EOS = 0
CONFIG = SchedulerConfig(
    page_size=4,
    eos_token_ids=frozenset({EOS}),
    vocab_size=VOCAB,
    chunked_prefill_size=8,
    disaggregation_bootstrap_timeout_s=30,
    disaggregation_waiting_timeout_s=20,
)
PROMPT = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]


def req(rid: str = "a", prompt=PROMPT, room: int | None = 1, **sampling) -> Request:
    sampling.setdefault("max_new_tokens", 6)
    sampling.setdefault("ignore_eos", True)
    boot = None if room is None else Bootstrap("p", 8998, room)
    return Request(rid, list(prompt), SamplingParams(**sampling), bootstrap=boot)


def expected(r: Request) -> list[int]:
    return expected_output(r.prompt_ids, r.sampling.max_new_tokens, VOCAB, frozenset())


def run(u, times: int = 1, lag: int = 0) -> None:
    for _ in range(times):
        u.tick(lag)
        u.check()


def nothing_held(sched) -> bool:
    """Every page free or cached and unlocked (the computed prompt stays cached)."""
    cache = sched.cache
    return cache.protected_pages == 0 and sched.pool.num_used == cache.evictable_pages


def units():
    clock = Clock()
    p, d = pd_units(CONFIG, 32, VOCAB, clock)
    return clock, p, d


# ------------------------------------------------------------- configuration
def test_the_mode_defaults_to_none_and_checks_its_values():
    assert SchedulerConfig().disaggregation_mode is None
    with pytest.raises(ValueError, match="disaggregation mode"):
        SchedulerConfig(disaggregation_mode="both")
    with pytest.raises(ValueError, match="timeouts"):
        SchedulerConfig(disaggregation_mode="decode", disaggregation_waiting_timeout_s=0)


def test_a_unit_that_is_not_disaggregated_refuses_a_room():
    sched, _ = make_pair(CONFIG, 32, VOCAB)
    assert sched.disagg is None
    with pytest.raises(InvalidRequestError, match="not disaggregated"):
        sched.add_request(req())


def test_a_room_serves_one_request_and_generates():
    _, p, d = units()
    p.sched.add_request(req("a", room=7))
    with pytest.raises(InvalidRequestError, match="room 7 is in use"):
        p.sched.add_request(req("b", room=7))
    with pytest.raises(InvalidRequestError, match="must generate"):
        d.sched.add_request(req("c", room=8, max_new_tokens=0))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_request_without_a_room_is_served_alone_on_either_role(mode):
    cfg = dataclasses.replace(CONFIG, disaggregation_mode=mode)
    sched, worker = make_pair(cfg, 32, VOCAB)
    r = req(room=None)
    drive(sched, worker, [(0, r)], overlap=True)
    assert r.output_ids == expected(r)


# ------------------------------------------------------------- prefill unit
def test_the_prefill_unit_waits_for_its_peer_then_sends_and_finishes_on_the_ack():
    _, p, _ = units()
    r = req(max_new_tokens=9)
    p.sched.add_request(r)
    assert r.place is Place.BOOTSTRAPPING and r.sampling.max_new_tokens == 1
    run(p, 3)
    assert r.place is Place.BOOTSTRAPPING and not r.pages  # nothing computed for nobody
    assert p.sched.disagg.peer_ready("a", 4)
    run(p, 4)
    assert r.place is Place.SENDING
    (send,) = p.sched.disagg.take_orders().sends
    assert send.prefix_len == 4 and send.first_token == expected(req(max_new_tokens=9))[0]
    # Positions 4..10 of the prompt: its pages from the second on, still held.
    assert list(send.pages) == r.pages.tolist()[1:] and send.prompt_len == len(PROMPT)
    assert p.deltas["a"] == [send.first_token] and "a" not in p.finished
    used = p.sched.pool.num_used
    run(p, 3)
    assert p.sched.pool.num_used == used  # held until the ack
    assert p.sched.disagg.sent("a")
    p.collect()
    assert r.finished and "a" in p.finished and r.output_ids == [send.first_token]
    assert p.sched.cache.protected_pages == 0 and p.sched.cache.cached_pages >= 2
    assert not p.sched.disagg.sent("a")  # a late duplicate is ignored


def test_a_decode_prefix_that_is_not_page_aligned_fails_the_request():
    _, p, _ = units()
    p.sched.add_request(req())
    r = p.sched.find("a")
    assert p.sched.disagg.peer_ready("a", 3)
    p.collect()
    assert "a" in p.finished and p.sched.stats.disagg_failed == 1
    assert "not a multiple of the page size 4" in r.finish_reason.message


def test_an_unclaimed_room_times_out_on_the_prefill_unit():
    clock, p, _ = units()
    r = req()
    p.sched.add_request(r)
    clock.now = 29.0
    run(p)
    assert r.place is Place.BOOTSTRAPPING
    clock.now = 30.0
    run(p)
    p.collect()
    assert isinstance(r.finish_reason, FinishAbort)
    assert r.finish_reason.code == TRANSFER_FAILED
    assert "not claimed by the decode unit within 30 s" in r.finish_reason.message


def test_an_unacknowledged_send_times_out_and_keeps_its_pages_until_the_engine_lets_go():
    clock, p, _ = units()
    r = req()
    p.sched.add_request(r)
    p.sched.disagg.peer_ready("a", 0)
    run(p, 4)
    assert r.place is Place.SENDING
    assert p.sched.disagg.take_orders().sends
    clock.now = 25.0
    run(p)
    assert r.finished and "within 20 s" in r.finish_reason.message
    assert p.sched.disagg.figures().closing == 1
    assert p.sched.disagg.take_orders().cancels == ["a"]
    assert p.sched.pool.num_used > 0 and not p.sched.is_idle()
    assert p.sched.disagg.failed("a", "cancelled")
    p.check()
    assert p.sched.is_idle() and nothing_held(p.sched)


def test_an_abort_while_sending_ends_the_call_at_once_and_the_pages_after_the_engine():
    _, p, _ = units()
    r = req()
    p.sched.add_request(r)
    p.sched.disagg.peer_ready("a", 0)
    run(p, 4)
    p.sched.abort("a")
    p.collect()
    assert "a" in p.finished and p.sched.pool.num_used > 0
    assert p.sched.disagg.take_orders().cancels == ["a"]
    assert p.sched.disagg.sent("a")  # the transfer had finished anyway: its pages go
    p.check()
    assert nothing_held(p.sched)


def test_the_prefill_worker_lost_while_sending_ends_the_request():
    _, p, _ = units()
    r = req()
    p.sched.add_request(r)
    p.sched.disagg.peer_ready("a", 0)
    run(p, 4)
    assert r.place is Place.SENDING
    p.lose_worker()
    assert r.finished and r.finish_reason.code == TRANSFER_FAILED
    assert "prefill worker was lost" in r.finish_reason.message
    assert p.sched.pool.num_used == 0 and not p.sched.disagg.closing


def test_the_prefill_worker_lost_before_the_first_token_prefills_again():
    _, p, _ = units()
    r = req()
    p.sched.add_request(r)
    p.sched.disagg.peer_ready("a", 0)
    run(p, 1, lag=1)
    p.lose_worker()
    assert r.place is Place.WAITING
    run(p, 4)
    assert r.place is Place.SENDING and r.output_ids == expected(req())[:1]


# -------------------------------------------------------------- decode unit
def test_the_decode_unit_preallocates_receives_and_decodes_as_if_it_prefilled():
    _, p, d = units()
    r = req(max_new_tokens=8)
    d.sched.add_request(r)
    assert r.place is Place.PREALLOC
    run(d, lag=1)
    assert r.place is Place.RECEIVING and r.kv_len == len(PROMPT)
    (recv,) = d.sched.disagg.take_orders().receives
    assert recv.prefix_len == 0 and list(recv.pages) == r.pages.tolist()
    # The prefill unit's side, then the copy, as the engine does it.
    pr = req(max_new_tokens=8)
    p.sched.add_request(pr)
    p.sched.disagg.peer_ready("a", recv.prefix_len)
    run(p, 4)
    (send,) = p.sched.disagg.take_orders().sends
    ps = CONFIG.page_size
    for sp, dp in zip(send.pages, recv.pages, strict=True):
        d.worker.slots[dp * ps : (dp + 1) * ps] = p.worker.slots[sp * ps : (sp + 1) * ps]
    assert d.sched.disagg.received("a", send.first_token, send.logprobs, cached_tokens=0)
    d.collect()
    assert d.deltas["a"] == [send.first_token]
    while not r.finished:
        run(d, lag=1)
    while d.inflight or not d.sched.is_idle():
        run(d, lag=1)
    assert r.output_ids == expected(req(max_new_tokens=8))
    assert d.sched.stats.disagg_received == 1


def test_a_prefix_the_decode_unit_has_cached_is_not_transferred():
    shared = PROMPT[:8]
    reqs = [
        (0, req("a", shared + [30, 31, 32], max_new_tokens=4), RoomPlan()),
        (30, req("b", shared + [33, 34], max_new_tokens=4), RoomPlan()),
    ]
    seen = []
    log = drive_pd(CONFIG, 32, VOCAB, reqs, overlap=1, on_receive=seen.append)
    check_pd(log, VOCAB, allow_abort=set())
    assert [(r.rid, r.prefix_len, len(r.pages)) for r in seen] == [("a", 0, 3), ("b", 8, 1)]


def test_the_first_token_can_finish_the_request_on_the_decode_unit():
    reqs = [(0, req("a", max_new_tokens=1), RoomPlan())]
    log = drive_pd(CONFIG, 32, VOCAB, reqs, overlap=1)
    check_pd(log, VOCAB, allow_abort=set())
    assert log.pairs["a"][1].output_ids == expected(req(max_new_tokens=1))
    assert log.decode.worker.steps == 0  # nothing left to compute


def test_a_receive_order_waits_for_the_plans_in_flight_at_allocation():
    _, _, d = units()
    d.sched.add_request(req("x", room=None, max_new_tokens=20))
    run(d, 2, lag=1)
    d.sched.add_request(req("a"))
    # Preallocated while a plan is in flight: a page freed while that plan
    # was built may still be written by it, so the peer may not write yet.
    d.inflight.append(d.sched.step())
    assert d.sched.find("a").place is Place.RECEIVING
    assert not d.sched.disagg.take_orders().receives
    d.sched.update(d.worker.execute(d.inflight.popleft()))
    assert d.sched.disagg.take_orders().receives


def test_preallocated_requests_count_against_the_running_limit():
    cfg = dataclasses.replace(CONFIG, max_running_requests=2, disaggregation_mode="decode")
    sched, _ = make_pair(cfg, 64, VOCAB)
    for i in range(3):
        sched.add_request(req(f"r{i}", room=i))
    sched.step()
    figures = sched.disagg.figures()
    assert (figures.receiving, figures.prealloc) == (2, 1)
    sched.add_request(req("alone", room=None))
    plan = sched.step()
    assert plan is None or not plan.extends  # admission sees the batch full


def test_a_transfer_that_never_lands_times_out_and_frees_every_page():
    clock, _, d = units()
    r = req()
    d.sched.add_request(r)
    run(d)
    assert d.sched.disagg.take_orders().receives
    clock.now = 21.0
    run(d)
    assert r.finished and "not filled by the prefill unit within 20 s" in r.finish_reason.message
    assert d.sched.disagg.take_orders().cancels == ["a"]
    assert d.sched.pool.num_used > 0
    d.sched.disagg.failed("a", "cancelled")
    d.check()
    assert d.sched.pool.num_used == 0 and d.sched.cache.cached_pages == 0  # nothing unfilled cached


def test_a_failed_transfer_frees_the_pages_it_would_have_filled():
    _, _, d = units()
    r = req()
    d.sched.add_request(r)
    run(d)
    d.sched.disagg.take_orders()
    assert d.sched.disagg.failed("a", "prefill unit gone")
    d.collect()
    assert r.finish_reason.message == "KV transfer for bootstrap room 1 failed: prefill unit gone"
    assert d.sched.pool.num_used == 0 and d.sched.cache.cached_pages == 0


def test_the_decode_worker_lost_mid_transfer_ends_the_request():
    _, _, d = units()
    r = req()
    d.sched.add_request(r)
    run(d)
    d.sched.disagg.take_orders()
    d.lose_worker()
    assert r.finished and "decode worker was lost" in r.finish_reason.message
    assert d.sched.disagg.take_orders().cancels == ["a"]
    assert not d.sched.disagg.received("a", 1)  # too late


def test_landed_kv_lost_with_the_worker_is_prefilled_on_the_decode_unit():
    _, _, d = units()
    r = req(max_new_tokens=5)
    d.sched.add_request(r)
    run(d)
    assert d.sched.disagg.take_orders().receives
    token = expected(req(max_new_tokens=5))[0]
    assert d.sched.disagg.received("a", token)  # (no KV copied: it is lost next)
    d.lose_worker()
    assert r.place is Place.WAITING and r.output_ids == [token]
    while not r.finished or d.inflight:
        run(d, lag=1)
    assert r.output_ids == expected(req(max_new_tokens=5))
