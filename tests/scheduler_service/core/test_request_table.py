"""The request table: every move checks the place it leaves, the place field
and the containers agree, leaving the worker is remembered for the next plan."""

from __future__ import annotations

import pytest

from scheduler_service.core.adapters import Adapter, AdapterSlots
from scheduler_service.core.request import IllegalMoveError, Place, Request
from scheduler_service.core.request_table import RequestTable


def table() -> RequestTable:
    return RequestTable(AdapterSlots(max_loaded=4, max_per_batch=2))


def test_a_life_with_a_chunked_prefill_a_retraction_and_a_finish():
    t = table()
    a = Request("a", [1, 2, 3])
    t.add(a, held=False)
    assert a.place is Place.WAITING and t.waiting == [a]
    t.admit([(a, Place.CHUNKED)])
    assert t.chunked is a and not t.waiting and a.on_worker
    t.admit([(a, Place.RUNNING)])  # its last chunk samples
    assert t.chunked is None and t.running == {"a": a}
    a.pending, epoch = 1, a.epoch
    t.requeue(a, now=5.0)
    assert t.waiting == [a] and not t.running and a.place is Place.WAITING
    assert a.epoch == epoch + 1 and a.pending == 0 and a.times.queue_entry == 5.0
    assert t.take_leaves() == ["a"] and t.take_leaves() == []
    t.admit([(a, Place.RUNNING)])
    assert t.remove(a) is Place.RUNNING
    assert a.place is Place.FINISHED and not len(t) and t.leaves == ["a"]
    t.check()


def test_held_siblings_are_released_into_the_queue():
    t = table()
    leader, sib = Request("r-0", [1]), Request("r-1", [1], waits_for="r-0")
    t.add(leader, held=False)
    t.add(sib, held=True)
    assert t.held == [sib] and sib.place is Place.HELD
    t.check()
    t.release(sib)
    assert t.waiting == [leader, sib] and not t.held
    t.check()


@pytest.mark.parametrize(
    "move",
    [
        lambda t, r: t.release(r),  # waiting, not held
        lambda t, r: t.requeue(r, 0.0),  # not on the worker
        lambda t, r: t.admit([(r, Place.WAITING)]),  # admission leads onto the worker
        lambda t, r: t.add(r, held=False),  # already in the table
    ],
)
def test_a_move_from_the_wrong_place_is_refused(move):
    t = table()
    r = Request("r", [1])
    t.add(r, held=False)
    with pytest.raises(IllegalMoveError):
        move(t, r)
    assert r.place is Place.WAITING and t.waiting == [r]
    t.check()


def test_a_finished_request_cannot_be_moved_again():
    t = table()
    r = Request("r", [1])
    t.add(r, held=False)
    t.remove(r)
    with pytest.raises(IllegalMoveError):
        t.remove(r)
    with pytest.raises(IllegalMoveError):
        t.admit([(r, Place.RUNNING)])


def test_a_worker_loss_requeues_what_the_worker_held_with_no_leaves():
    slots = AdapterSlots(max_loaded=4, max_per_batch=2)
    slots.register(Adapter("x", "x", "/x"))
    t = RequestTable(slots)
    old, new, queued = Request("old", [1]), Request("new", [1]), Request("queued", [1])
    old.times.arrival, new.times.arrival = 1.0, 2.0
    for r in (new, old, queued):
        t.add(r, held=False)
    t.admit([(new, Place.CHUNKED), (old, Place.RUNNING)])
    old.adapter_slot = slots.acquire("x")
    t.requeue(old, 0.0)  # leaves the worker: its slot and a leave
    assert t.leaves == ["old"] and old.adapter_slot == 0 and not any(slots.users)
    t.admit([(old, Place.RUNNING)])
    lost = t.requeue_after_loss(now=9.0)
    assert lost == [old, new] and t.waiting == [old, new, queued]
    assert t.leaves == [] and t.chunked is None and not t.running
    t.check()


def test_check_catches_a_place_that_disagrees_with_its_container():
    t = table()
    r = Request("r", [1])
    t.add(r, held=False)
    r.place = Place.RUNNING  # not through the table
    with pytest.raises(AssertionError, match="waiting container"):
        t.check()
