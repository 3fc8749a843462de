"""Drives a prefill unit and a decode unit (each a Scheduler with its
SimulatedWorker) against a simulated transfer engine, and checks them.

The engine does what the real one will: it relays a decode unit's claim of
a room (its receive order) to the prefill unit (``peer_ready``), copies the
pages a send names into the pages the receive names (the simulated
workers' slots, so the decode worker's read check sees wrong or missing KV),
then acknowledges both sides; it answers every cancel with ``failed``, and
tells a unit when its peer ended the request. Per room it can misbehave:
never claim, fail the transfer, or go silent (both sides time out). Worker
losses replace a unit's worker and drop its plans in flight.

Integrity is checked on both units after every step, update and engine
event; at the end every decode unit's output is the oracle's (a prefix of
it for a request that failed or was aborted), and both units are drained.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core import FinishAbort, Request, Scheduler, SchedulerConfig
from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.disagg.orders import KvReceive, KvSend
from scheduler_service.testing.simulated_worker import SimulatedWorker
from tests.scheduler_service.core.support.sim_driver import (
    DriveLog,
    check_drained,
    check_outputs,
    make_pair,
)

FAULTS = (None, "no_claim", "fail", "silent")


@dataclass
class RoomPlan:
    """How the simulated engine treats one room."""

    fault: str | None = None
    claim_delay: int = 0
    send_delay: int = 0


@dataclass
class _Room:
    rid: str
    plan: RoomPlan
    recv: KvReceive | None = None
    recv_at: int = 0
    send: KvSend | None = None
    send_at: int = 0
    claimed: bool = False
    done: bool = False
    dead: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Unit:
    name: str
    sched: Scheduler
    worker: SimulatedWorker
    config: SchedulerConfig
    num_pages: int
    vocab: int
    inflight: deque = field(default_factory=deque)
    deltas: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def collect(self) -> None:
        for d in self.sched.drain():
            rid = d.req.rid
            if rid in self.finished:
                raise AssertionError(f"{self.name}: {rid} got a delta after finishing")
            self.deltas.setdefault(rid, []).extend(d.new_token_ids)
            if d.finished:
                self.finished.add(rid)

    def check(self) -> None:
        self.sched.check_integrity()

    def tick(self, lag: int) -> None:
        plan = self.sched.step()
        self.check()
        if plan is not None:
            self.inflight.append(plan)
        while self.inflight and (len(self.inflight) > lag or plan is None):
            done = self.inflight.popleft()
            self.sched.update(self.worker.execute(done))
            self.check()
        self.collect()

    def lose_worker(self) -> None:
        self.sched.reset_after_worker_loss()
        self.inflight.clear()
        self.worker = SimulatedWorker(self.num_pages, self.config.page_size, self.vocab)
        self.check()
        self.collect()


def pd_units(
    config: SchedulerConfig, num_pages: int, vocab: int, clock: Clock
) -> tuple[Unit, Unit]:
    units = []
    for mode in ("prefill", "decode"):
        cfg = dataclasses.replace(config, disaggregation_mode=mode)
        sched, worker = make_pair(cfg, num_pages, vocab, clock=clock)
        units.append(Unit(mode, sched, worker, cfg, num_pages, vocab))
    return units[0], units[1]


def announced_pair(req: Request, room: int) -> tuple[Request, Request]:
    """The request as the gateway sends it to each unit (same params, same room)."""
    pair = []
    for _ in range(2):
        r = Request(
            req.rid,
            list(req.prompt_ids),
            req.sampling,
            req.logprobs,
            priority=req.priority,
            extra_key=req.extra_key,
            bootstrap=Bootstrap("prefill.local", 8998, room),
        )
        pair.append(r)
    return pair[0], pair[1]


@dataclass
class PdLog:
    prefill: Unit
    decode: Unit
    # rid -> (the prefill unit's request, the decode unit's)
    pairs: dict[str, tuple[Request, Request]]
    steps: int = 0


def drive_pd(
    config: SchedulerConfig,
    num_pages: int,
    vocab: int,
    arrivals: list[tuple[int, Request, RoomPlan]],
    *,
    aborts: dict[int, list[str]] | None = None,
    losses: dict[int, list[str]] | None = None,
    overlap: int = 1,
    max_steps: int = 20_000,
    on_receive=None,
) -> PdLog:
    """Run both units until every request is done and nothing is held.
    ``arrivals``: (tick, request, how the engine treats its room); the
    request reaches both units at that tick. ``aborts``: tick -> rids the
    client drops (both units); ``losses``: tick -> units ("prefill",
    "decode") whose worker is lost. One tick is one second of the clock.
    ``on_receive``: called with each receive order."""
    clock = Clock()
    p, d = pd_units(config, num_pages, vocab, clock)
    units = {"prefill": p, "decode": d}
    aborts = aborts or {}
    losses = losses or {}
    todo = deque(sorted(arrivals, key=lambda a: a[0]))
    rooms: dict[str, _Room] = {}
    pairs: dict[str, tuple[Request, Request]] = {}
    ends: list[tuple[int, Unit, str]] = []  # (tick, unit, rid): cancels the engine answers
    t = 0
    while True:
        clock.now = float(t)
        while todo and todo[0][0] <= t:
            _, req, plan = todo.popleft()
            room = len(pairs) + 1
            pairs[req.rid] = announced_pair(req, room)
            rooms[req.rid] = _Room(req.rid, plan)
            p.sched.add_request(pairs[req.rid][0])
            d.sched.add_request(pairs[req.rid][1])
        for rid in aborts.get(t, ()):
            p.sched.abort(rid, "test abort")
            d.sched.abort(rid, "test abort")
        for name in losses.get(t, ()):
            units[name].lose_worker()
        for u in (p, d):
            u.collect()
            u.tick(overlap)
            _take_orders(u, p, rooms, ends, t, on_receive)
        _run_engine(p, d, rooms, ends, t)
        for u in (p, d):
            u.collect()
            u.check()
        t += 1
        idle = all(u.sched.is_idle() and not u.inflight for u in (p, d))
        if not todo and not ends and idle:
            break
        if t >= max_steps:
            raise AssertionError(f"not done after {max_steps} steps")
    return PdLog(p, d, pairs, t)


def _take_orders(
    u: Unit, p: Unit, rooms: dict[str, _Room], ends: list, t: int, on_receive=None
) -> None:
    orders = u.sched.disagg.take_orders()
    for s in orders.sends:
        assert u is p, "a decode unit sent KV"
        room = rooms[s.rid]
        assert room.send is None, f"{s.rid}: sent twice"
        room.send, room.send_at = s, t
    for r in orders.receives:
        assert u is not p, "a prefill unit received KV"
        room = rooms[r.rid]
        assert room.recv is None, f"{r.rid}: received twice"
        room.recv, room.recv_at = r, t
        if on_receive is not None:
            on_receive(r)
    for rid in orders.cancels:
        rooms[rid].dead = True
        ends.append((t + 1, u, rid))


def _run_engine(p: Unit, d: Unit, rooms: dict[str, _Room], ends: list, t: int) -> None:
    due = [e for e in ends if e[0] <= t]
    ends[:] = [e for e in ends if e[0] > t]
    for _, u, rid in due:
        u.sched.disagg.failed(rid, "cancelled")
        u.check()
    for room in rooms.values():
        rid, plan = room.rid, room.plan
        if room.dead or room.done:
            continue
        if (
            room.recv is not None
            and not room.claimed
            and t >= room.recv_at + plan.claim_delay
            and plan.fault != "no_claim"
        ):
            room.claimed = True
            p.sched.disagg.peer_ready(rid, room.recv.prefix_len)
            p.check()
        if room.send is None or room.recv is None or t < room.send_at + plan.send_delay:
            continue
        if plan.fault == "silent":
            continue
        if plan.fault == "fail":
            room.dead = True
            p.sched.disagg.failed(rid, "link down")
            d.sched.disagg.failed(rid, "link down")
        else:
            _copy(p, d, room.send, room.recv)
            room.done = True
            s = room.send
            p.sched.disagg.sent(rid)
            d.sched.disagg.received(rid, s.first_token, s.logprobs, cached_tokens=s.cached_tokens)
        p.check()
        d.check()
    _relay_peer_ends(p, d, rooms)


def _relay_peer_ends(p: Unit, d: Unit, rooms: dict[str, _Room]) -> None:
    """A unit that ended a request with an error (failure, timeout, abort,
    lost worker): the engine tells the other unit, which stops waiting."""
    for room in rooms.values():
        if room.done:
            continue
        for ended, other in ((p, d), (d, p)):
            req = ended.sched.find(room.rid)
            if req is not None or room.rid not in ended.finished:
                continue
            if other.sched.find(room.rid) is not None:
                room.dead = True
                other.sched.disagg.failed(room.rid, f"the {ended.name} unit ended the request")
                other.check()


def _copy(p: Unit, d: Unit, send: KvSend, recv: KvReceive) -> None:
    """The transfer: the prefill worker's KV slots into the decode worker's."""
    assert send.prefix_len == recv.prefix_len and send.prompt_len == recv.prompt_len
    assert len(send.pages) == len(recv.pages), f"{send.rid}: {send.pages} -> {recv.pages}"
    ps = p.config.page_size
    for sp, dp in zip(send.pages, recv.pages, strict=True):
        src, dst = sp * ps, dp * ps
        d.worker.slots[dst : dst + ps] = p.worker.slots[src : src + ps]
        d.worker.slot_adapter[dst : dst + ps] = p.worker.slot_adapter[src : src + ps]


def check_pd(log: PdLog, vocab: int, *, allow_abort: set[str]) -> None:
    """Decode outputs are the oracle's; the prefill unit answered the first
    token of each request it sent; both units hold nothing."""
    p, d = log.prefill, log.decode
    decode_log = DriveLog(deltas=d.deltas, finished_deltas=dict.fromkeys(d.finished, 1))
    check_outputs(
        [dr for _, dr in log.pairs.values()], d.config, vocab, decode_log, allow_abort=allow_abort
    )
    for rid, (pr, dr) in log.pairs.items():
        assert pr.finished and dr.finished, f"{rid} did not finish on both units"
        assert p.deltas.get(rid, []) == pr.output_ids, f"{rid}: prefill deltas != output"
        assert rid in p.finished, f"{rid}: no finished delta on the prefill unit"
        if not isinstance(dr.finish_reason, FinishAbort) and dr.output_ids:
            assert pr.output_ids == dr.output_ids[:1], f"{rid}: first tokens differ"
    for u in (p, d):
        assert not u.sched.disagg.transfers and not u.sched.disagg.closing
        check_drained(u.sched, u.worker)
