"""The prefill unit's bootstrap rooms (engine/bootstrap_rooms.py): a decode
unit's claim and a prefill request meet by room in either order, a room is
claimed and waited for once, a claim nobody takes expires, a forgotten room
leaves nothing behind."""

from __future__ import annotations

from scheduler_service.engine.bootstrap_rooms import BootstrapRooms
from scheduler_service.engine.kv_sends import DecodePeer

PEER = DecodePeer(("10.0.0.2:5000",), (3, 4))


def test_claim_and_request_meet_in_either_order():
    now = [0.0]
    rooms = BootstrapRooms(lambda: now[0])
    assert rooms.claim(1, PEER, 16) is None
    assert rooms.match() == []
    assert rooms.wait(1, "a") is None
    assert rooms.wait(2, "b") is None
    [(rid, claim)] = rooms.match()
    assert (rid, claim.room, claim.peer, claim.prefix_len) == ("a", 1, PEER, 16)
    assert rooms.claim(2, PEER, 0) is None
    assert [(r, c.room) for r, c in rooms.match()] == [("b", 2)]
    assert len(rooms) == 0


def test_a_room_is_claimed_and_waited_for_once():
    rooms = BootstrapRooms(lambda: 0.0)
    assert rooms.claim(5, PEER, 0) is None
    assert "claimed already" in (rooms.claim(5, PEER, 0) or "")
    assert rooms.wait(5, "a") is None
    assert "taken" in (rooms.wait(5, "b") or "")


def test_an_untaken_claim_expires_and_a_forgotten_room_is_gone():
    now = [0.0]
    rooms = BootstrapRooms(lambda: now[0], ttl_s=10)
    rooms.claim(1, PEER, 0)
    now[0] = 5.0
    rooms.claim(2, PEER, 0)
    now[0] = 10.0
    assert [c.room for c in rooms.expire()] == [1]
    rooms.wait(3, "c")
    rooms.forget(2)
    rooms.forget(3)
    assert len(rooms) == 0 and rooms.match() == []
