"""RequestTable: where every live request is, and the only code that moves one.

A request's place is one field, ``Request.place`` (request.py has the map of
places); the table keeps a container per place and every move is a method
that checks the place the request is leaving, so the field and the
containers cannot disagree (``check`` verifies it for every request).

Leaving a place where the worker holds the request's state (``ON_WORKER``)
tells the worker to drop it: the rid goes into ``leaves``, which the next
plan carries, and the request gives back its adapter slot. After a worker
loss nothing is sent: the new worker holds nothing.

The disaggregation places (``PARKED``, core/disagg/) share one container,
``parked``; ``park`` and ``unpark`` are their moves, each allowed only
along the edges ``_PARK_EDGES`` / ``_UNPARK_EDGES`` name.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.request import ON_WORKER, PARKED, IllegalMoveError, Place, Request

_ADMITTED = frozenset({Place.CHUNKED, Place.RUNNING, Place.SCORING})
# Into a parked place: (from, to).
_PARK_EDGES = frozenset(
    {
        (Place.NEW, Place.BOOTSTRAPPING),  # a prefill unit's announced request
        (Place.NEW, Place.PREALLOC),  # a decode unit's announced request
        (Place.PREALLOC, Place.RECEIVING),  # its pages are allocated
        (Place.RUNNING, Place.SENDING),  # its first token came back
    }
)
# Out of a parked place into the scheduler's own (finishing is ``remove``).
_UNPARK_EDGES = frozenset(
    {
        (Place.BOOTSTRAPPING, Place.WAITING),  # the decode unit claimed its room
        (Place.RECEIVING, Place.RUNNING),  # its KV landed (its join is on the plan)
        (Place.RECEIVING, Place.WAITING),  # its KV landed, then the worker was lost
    }
)


class RequestTable:
    def __init__(self, adapters: AdapterSlots) -> None:
        self._adapters = adapters
        self.by_rid: dict[str, Request] = {}
        self.waiting: list[Request] = []  # the queue: the policy orders it in place
        self.held: list[Request] = []  # n > 1 siblings, until their leader is planned
        self.running: dict[str, Request] = {}  # the decode batch, in join order
        self.chunked: Request | None = None  # at most one prefill continues
        self.scoring: dict[str, Request] = {}  # max_new_tokens 0, prefill in flight
        self.leaves: list[str] = []  # rids whose worker state the next plan drops
        self.parked: dict[str, Request] = {}  # the disaggregation places, core/disagg/

    # ------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self.by_rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self.by_rid

    def __iter__(self) -> Iterator[Request]:
        return iter(self.by_rid.values())

    def get(self, rid: str) -> Request | None:
        return self.by_rid.get(rid)

    def on_worker(self) -> list[Request]:
        """The requests whose KV the worker holds, running ones first."""
        held = list(self.running.values())
        if self.chunked is not None:
            held.append(self.chunked)
        held.extend(self.scoring.values())
        return held

    # --------------------------------------------------------------- moves
    def _expect(self, req: Request, *places: Place) -> None:
        if req.place not in places:
            want = " or ".join(p.value for p in places)
            raise IllegalMoveError(f"request {req.rid} is {req.place.value}, not {want}")

    def add(self, req: Request, held: bool) -> None:
        """A new request: HELD (``held``: its leader's prompt is not planned
        yet) or WAITING."""
        self._expect(req, Place.NEW)
        if req.rid in self.by_rid:
            raise IllegalMoveError(f"request id {req.rid!r} is already in the table")
        self.by_rid[req.rid] = req
        if held:
            req.place = Place.HELD
            self.held.append(req)
        else:
            req.place = Place.WAITING
            self.waiting.append(req)

    def release(self, req: Request) -> None:
        """HELD -> WAITING: its leader's prompt is planned (and so cached)."""
        self._expect(req, Place.HELD)
        self.held.remove(req)
        req.place = Place.WAITING
        self.waiting.append(req)

    def admit(self, moves: list[tuple[Request, Place]]) -> None:
        """WAITING or CHUNKED -> CHUNKED, RUNNING or SCORING, for each (request,
        place): its prefill (or a chunk of it) is in this step's plan, whose
        join put it on the worker. The queue is rebuilt once for all."""
        taken: set[int] = set()
        for req, to in moves:
            if to not in _ADMITTED:
                raise IllegalMoveError(f"request {req.rid}: admitted to {to.value}")
            self._expect(req, Place.WAITING, Place.CHUNKED)
            if req.place is Place.WAITING:
                taken.add(id(req))
        if taken:
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        for req, to in moves:
            if req.place is Place.CHUNKED and to is not Place.CHUNKED:
                self.chunked = None
            if to is Place.CHUNKED:
                if self.chunked is not None and self.chunked is not req:
                    raise IllegalMoveError(f"{req.rid} chunked while {self.chunked.rid} is")
                self.chunked = req
            elif to is Place.RUNNING:
                self.running[req.rid] = req
            else:
                self.scoring[req.rid] = req
            req.place = to

    def park(self, req: Request, to: Place) -> None:
        """Into a disaggregation place (``_PARK_EDGES``); leaving RUNNING
        leaves the worker."""
        was = req.place
        if (was, to) not in _PARK_EDGES:
            raise IllegalMoveError(f"request {req.rid}: {was.value} -> {to.value}")
        if was is Place.NEW:
            if req.rid in self.by_rid:
                raise IllegalMoveError(f"request id {req.rid!r} is already in the table")
            self.by_rid[req.rid] = req
        elif was is Place.RUNNING:
            self._take_out(req)
            self._leave_worker(req)
        self.parked[req.rid] = req
        req.place = to

    def unpark(self, req: Request, to: Place, now: float) -> None:
        """Out of a disaggregation place (``_UNPARK_EDGES``): to WAITING (at
        the back; a request whose KV was lost waits again), or to RUNNING
        (the caller puts its join on the plan being built)."""
        was = req.place
        if (was, to) not in _UNPARK_EDGES:
            raise IllegalMoveError(f"request {req.rid}: {was.value} -> {to.value}")
        del self.parked[req.rid]
        req.place = to
        if to is Place.RUNNING:
            self.running[req.rid] = req
            return
        if was is Place.RECEIVING:
            req.back_to_wait(now)
        else:
            req.times.queue_entry = now
        self.waiting.append(req)

    def requeue(self, req: Request, now: float, front: bool = False) -> None:
        """CHUNKED, RUNNING or SCORING -> WAITING (retraction, preemption): its
        KV was released, it leaves the worker and waits again, keeping its
        output; ``front``: first in line (a chunked prefill put back)."""
        self._expect(req, *ON_WORKER)
        self._take_out(req)
        self._leave_worker(req)
        req.back_to_wait(now)
        req.place = Place.WAITING
        if front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def requeue_after_loss(self, now: float) -> list[Request]:
        """Every request the lost worker held -> the front of WAITING, oldest
        first: nothing is sent (the new worker holds nothing), every adapter
        slot is free again. Returns them."""
        lost = sorted(self.on_worker(), key=lambda r: r.times.arrival)
        self.running.clear()
        self.chunked = None
        self.scoring.clear()
        self.leaves.clear()
        for req in lost:
            req.adapter_slot = 0
            req.back_to_wait(now)
            req.place = Place.WAITING
        self.waiting[:0] = lost
        return lost

    def remove(self, req: Request) -> Place:
        """Any live place -> FINISHED (the caller releases its KV and records
        why). Returns the place it left."""
        if self.by_rid.get(req.rid) is not req:
            raise IllegalMoveError(f"request {req.rid} is not in the table")
        was = req.place
        if was is Place.HELD:
            self.held.remove(req)
        elif was is Place.WAITING:
            self.waiting.remove(req)
        elif was in PARKED:
            del self.parked[req.rid]
        else:
            self._expect(req, *ON_WORKER)
            self._take_out(req)
            self._leave_worker(req)
        del self.by_rid[req.rid]
        req.place = Place.FINISHED
        return was

    def take_leaves(self) -> list[str]:
        leaves, self.leaves = self.leaves, []
        return leaves

    def _take_out(self, req: Request) -> None:
        if req.place is Place.RUNNING:
            del self.running[req.rid]
        elif req.place is Place.SCORING:
            del self.scoring[req.rid]
        else:
            self.chunked = None

    def _leave_worker(self, req: Request) -> None:
        self.leaves.append(req.rid)
        if req.adapter_slot:
            self._adapters.release(req.adapter_slot)
            req.adapter_slot = 0

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Every live request is in exactly the container its place names."""
        seen: dict[str, str] = {}

        def place(req: Request, where: Place) -> None:
            if req.place is not where:
                raise AssertionError(
                    f"{req.rid} is in the {where.value} container but says {req.place.value}"
                )
            if req.rid in seen:
                raise AssertionError(f"{req.rid} is both {seen[req.rid]} and {where.value}")
            if self.by_rid.get(req.rid) is not req:
                raise AssertionError(f"{req.rid} ({where.value}) is not a live request")
            seen[req.rid] = where.value

        for req in self.waiting:
            place(req, Place.WAITING)
        for req in self.held:
            place(req, Place.HELD)
        for rid, req in self.running.items():
            if rid != req.rid:
                raise AssertionError(f"running {req.rid} filed under {rid}")
            place(req, Place.RUNNING)
        if self.chunked is not None:
            place(self.chunked, Place.CHUNKED)
        for rid, req in self.scoring.items():
            if rid != req.rid:
                raise AssertionError(f"scoring {req.rid} filed under {rid}")
            place(req, Place.SCORING)
        for rid, req in self.parked.items():
            if rid != req.rid or req.place not in PARKED:
                raise AssertionError(f"parked {req.rid} ({req.place.value}) filed under {rid}")
            place(req, req.place)
        missing = set(self.by_rid) - set(seen)
        if missing:
            raise AssertionError(f"live requests in no container: {sorted(missing)[:5]}")
