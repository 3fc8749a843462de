"""PrefillTransfers, the prefill unit's engine side: decode units' claims
(ClaimInbox, as the bootstrap server hands them over) meet the core's
BOOTSTRAPPING requests by room in either order; a claim nobody announces
expires; a claim of another page size is refused and a withdrawn claim
fails its request. A real prefill-mode Scheduler; the carrier is not
reached (no request gets as far as its send here)."""

from __future__ import annotations

import dataclasses

import grpc

from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.request import Place
from scheduler_service.engine.bootstrap_server import ClaimInbox, PendingClaim
from scheduler_service.engine.kv_sends import DecodePeer, KvSendCarrier
from scheduler_service.engine.prefill_transfers import PrefillTransfers
from scheduler_service.engine.wakeup import Wakeup

PAGE = 4
PROMPT = list(range(3, 14))  # 11 tokens: 3 pages
CONFIG = SchedulerConfig(page_size=PAGE, vocab_size=40, disaggregation_mode="prefill")


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(ttl_s: float = 5.0):
    clock = Clock()
    sched = Scheduler(dataclasses.replace(CONFIG), 32, clock=clock)
    wakeup = Wakeup()
    inbox = ClaimInbox(wakeup)
    assert sched.disagg is not None
    prefill = PrefillTransfers(
        sched.disagg,
        KvSendCarrier([]),
        inbox,
        page_size=PAGE,
        model="m",
        clock=clock,
        claim_ttl_s=ttl_s,
    )
    return clock, sched, inbox, prefill


def claim(room: int, pages: int = 3, page_size: int = PAGE) -> PendingClaim:
    return PendingClaim(
        room=room,
        peer=DecodePeer(("d:1",), tuple(range(pages))),
        prefix_len=0,
        prompt_len=len(PROMPT),
        page_size=page_size,
        model="m",
    )


def submit(sched: Scheduler, room: int, rid: str = "a") -> Request:
    boot = Bootstrap("p", 1, room)
    r = Request(rid, list(PROMPT), SamplingParams(max_new_tokens=4), bootstrap=boot)
    sched.add_request(r)
    return r


def test_a_claim_may_come_before_or_after_its_request():
    _, sched, inbox, prefill = setup()
    early = claim(1)
    inbox.put(early)
    prefill.pump()
    r1 = submit(sched, 1, "a")
    assert r1.place is Place.BOOTSTRAPPING
    prefill.pump()
    assert r1.place is Place.WAITING and not early.done.is_set()
    r2 = submit(sched, 2, "b")
    prefill.pump()
    assert r2.place is Place.BOOTSTRAPPING
    inbox.put(claim(2))
    prefill.pump()
    assert r2.place is Place.WAITING
    sched.check_integrity()


def test_a_claim_nobody_announces_expires_and_a_second_claim_is_refused():
    clock, _, inbox, prefill = setup(ttl_s=5)
    first, second = claim(7), claim(7)
    inbox.put(first)
    inbox.put(second)
    prefill.pump()
    assert second.code is grpc.StatusCode.ALREADY_EXISTS
    clock.now = 6
    prefill.pump()
    assert first.code is grpc.StatusCode.NOT_FOUND and "room 7" in first.message


def test_another_page_size_or_too_few_pages_are_refused():
    _, sched, inbox, prefill = setup()
    wrong = claim(3, page_size=8)
    inbox.put(wrong)
    prefill.pump()
    assert wrong.code is grpc.StatusCode.FAILED_PRECONDITION and "page size" in wrong.message
    r = submit(sched, 4)
    short = claim(4, pages=2)
    inbox.put(short)
    prefill.pump()
    assert short.code is grpc.StatusCode.FAILED_PRECONDITION
    assert r.place is Place.FINISHED
    sched.check_integrity()


def test_a_withdrawn_claim_fails_its_request():
    _, sched, inbox, prefill = setup()
    r = submit(sched, 5)
    c = claim(5)
    inbox.put(c)
    prefill.pump()
    assert r.place is Place.WAITING
    inbox.withdrawn(c)
    prefill.pump()
    assert r.place is Place.FINISHED
    assert "withdrew" in r.finish_reason.message
    sched.check_integrity()
