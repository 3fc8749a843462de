"""The prefill unit's table of bootstrap rooms (prefill/decode
disaggregation; SGLang's bootstrap server, keyed by room). The gateway
sends a request to both units at once, so either side may come first: a
decode unit's claim (where its workers are, the pages it allocated, what
it has cached) waits here for the prefill request of the same room, and a
prefill request waits (in the core, BOOTSTRAPPING) for the claim. The
engine matches them with ``match``: then it calls the core's
``peer_ready(rid, prefix_len)`` and keeps the peer for the ``KvSend``.

Not yet wired: the claims' transport (a bootstrap RPC on the prefill
unit's bootstrap port) and the engine loop (docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.engine.kv_sends import DecodePeer


@dataclass(frozen=True, slots=True)
class RoomClaim:
    room: int
    peer: DecodePeer
    prefix_len: int  # the decode unit's cached prefix (page aligned)
    at: float = 0.0  # when it was claimed (the table's clock)


class BootstrapRooms:
    def __init__(self, clock: Callable[[], float], ttl_s: float = 300.0) -> None:
        """``ttl_s``: how long a claim waits for its prefill request."""
        self._clock = clock
        self._ttl_s = ttl_s
        self._claims: dict[int, RoomClaim] = {}
        self._waiting: dict[int, str] = {}  # room -> rid of a prefill request

    def claim(self, room: int, peer: DecodePeer, prefix_len: int) -> str | None:
        """A decode unit claims ``room``; the refusal's reason, or None."""
        if room in self._claims:
            return f"room {room} is claimed already"
        self._claims[room] = RoomClaim(room, peer, prefix_len, self._clock())
        return None

    def wait(self, room: int, rid: str) -> str | None:
        """A prefill request ``rid`` announced ``room``; the refusal's reason, or None."""
        if room in self._waiting:
            return f"room {room} is taken by another request"
        self._waiting[room] = rid
        return None

    def match(self) -> list[tuple[str, RoomClaim]]:
        """(rid, claim) of every room both sides reached; they leave the table."""
        both = [room for room in self._waiting if room in self._claims]
        return [(self._waiting.pop(room), self._claims.pop(room)) for room in both]

    def forget(self, room: int) -> None:
        """The prefill request of ``room`` ended (abort, timeout, failure)."""
        self._waiting.pop(room, None)
        self._claims.pop(room, None)

    def expire(self) -> list[RoomClaim]:
        """Claims no prefill request took within the ttl (the decode unit is
        told so and fails its request)."""
        now = self._clock()
        old = [c for c in self._claims.values() if now - c.at >= self._ttl_s]
        for c in old:
            del self._claims[c.room]
        return old

    def __len__(self) -> int:
        return len(self._claims) + len(self._waiting)
