"""The API process's side of the pipe to the core process.

Routes the core's per-step outputs to the coroutines serving each Generate
call (one asyncio queue per call, shared by its n samples), keeps the latest
load snapshot, answers flushes, and fans KV events out to subscribers. It
runs on the API process's event loop, fed by the CoreSupervisor
(core_supervisor.py), which spawns the core, restarts it when it dies and
tells this object when it goes down (the calls in flight end) and comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from scheduler_service import ipc
from scheduler_service.api.inbox import Inbox
from scheduler_service.config import ServiceConfig
from scheduler_service.core.intake import Submission
from scheduler_service.core.kv.events import AllBlocksCleared

logger = structlog.get_logger(__name__)


@dataclass
class Call:
    """One Generate call: its samples' rids and the queue their outputs go to.

    ``rids`` are internal: each sample's public rid with ``#`` and a number
    unique in this process (``submit`` gives them), so that the core, the
    workers and the output routing never mix two calls that reuse a public
    id (a client that cancels X and at once sends X again). ``public`` are
    the public sample rids, held (refusing a second live call with the same
    id) until the call is cancelled, aborted or over."""

    rids: list[str]
    public: list[str] = field(default_factory=list)
    queue: Inbox = field(default_factory=Inbox)
    # samples with no output yet: they count against --max-queued-requests
    # (those of a bounded call)
    unstarted: set[str] = field(default_factory=set)
    # set once the public rids are free again
    released: asyncio.Event = field(default_factory=asyncio.Event)
    # custom_params priority (its samples share it), and the order the call
    # came in: a full queue evicts the least preferred, newest first
    priority: int = 0
    number: int = 0


class CoreUnavailable(RuntimeError):
    code = "UNAVAILABLE"


class CoreBroken(CoreUnavailable):
    """The core stopped on a bug of its own (e.g. --check-integrity caught one)."""

    code = "INTERNAL"


class DrainEnded(CoreUnavailable):
    """The server shut down (its drain timed out) before the call finished."""


class CoreRestarting(CoreUnavailable):
    """The core process died and a successor is on its way. The message names
    the core (never "no worker"): the workers are fine."""


class Pipe(Protocol):
    """The API process's end of the current core's pipe."""

    def send(self, msg: object) -> None: ...


class QueueFull(RuntimeError):
    """Too many samples wait for their first token (--max-queued-requests)."""


class Evicted(QueueFull):
    """This call waited in a full queue and a call of higher priority took
    its place (--enable-priority-scheduling, SGLang's rule): it ends with
    RESOURCE_EXHAUSTED, like a newcomer the full queue refuses."""


class CoreClient:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.ready: ipc.Ready | None = None
        self.load: ipc.Load | None = None
        # Why no work can be taken now (None: it can): the core failed, or
        # died and is being restarted; new work meets error().
        self.failed: str | None = None
        self._failure: type[CoreUnavailable] = CoreUnavailable
        # Why this process cannot serve again by itself (liveness).
        self.stuck: str | None = None
        self.restarts = 0  # successors that came up
        self._calls: dict[str, Call] = {}  # internal sample rid -> its call
        self._public: dict[str, Call] = {}  # public sample rid -> its live call
        self._call_numbers = itertools.count(1)
        # Samples submitted that have had no output (token, finish or
        # rejection) yet. Counted here, on the event loop that also submits,
        # so the bound is exact: no snapshot from the core can lag behind it.
        self.queued = 0
        self._flushes: dict[int, asyncio.Future] = {}
        self._adapter_ops: dict[int, asyncio.Future] = {}
        # The LoRA adapters loaded, as of the core's last word (Ready, then
        # every load or unload answer): what Generate checks lora_id against.
        self.adapters: list[ipc.AdapterInfo] = []
        self._tokens = itertools.count(1)
        self._event_listeners: list[Callable[[list, ipc.Load], None]] = []
        self._load_listeners: list[Callable[[ipc.Load], None]] = []
        self._change_listeners: list[Callable[[], None]] = []
        self._pipe: Pipe | None = None
        # New calls wait on it while a successor core is on its way (set: a
        # core takes work, or nobody may wait any more).
        self._wake = asyncio.Event()
        self._holding = True  # False once the server drains
        self.held = 0  # samples of the calls waiting on it

    # ------------------------------------------------------------ up, down
    def attach(self, pipe: Pipe | None) -> None:
        """The pipe to the current core (None: there is none)."""
        self._pipe = pipe

    def up(self, ready: ipc.Ready, adapters: list[ipc.AdapterInfo] | None = None) -> None:
        """A core is ready (the first, or a successor with ``adapters`` loaded
        since its Ready): work is taken again."""
        self.ready = ready
        self.adapters = ready.adapters if adapters is None else adapters
        self.failed, self.stuck = None, None
        self._wake.set()
        self._changed()

    def down(self, message: str, failure: type[CoreUnavailable] = CoreUnavailable) -> None:
        """The core stopped: the calls in flight and pending operations end
        with ``failure(message)``, as does new work until ``up``."""
        self.failed, self._failure = message, failure
        self._sleep()
        error = self.error()
        self.fail_pending(error)
        for call in {id(c): c for c in self._calls.values()}.values():
            call.queue.put_nowait(error)
        self._cache_gone()
        self._changed()

    def still_down(
        self, message: str, failure: type[CoreUnavailable], stuck: str | None = None
    ) -> None:
        """What new work meets from now on (nothing is in flight); ``stuck``:
        why only a restart of this process would help (liveness)."""
        self.failed, self._failure, self.stuck = message, failure, stuck
        self._sleep()
        self._changed()

    def _sleep(self) -> None:
        if self._holding:
            self._wake.clear()

    async def wait_restart(self, samples: int) -> None:
        """While a successor core is on its way, a new call waits for it (at
        most --worker-recovery-timeout) instead of failing at once, as
        requests wait out a lost worker group: a gateway in front retries a refused call a few
        times within a second and counts each refusal against the unit, so
        refusing for the seconds of a restart opened its circuit breaker for
        a minute (docs/design.md section 4, Core loss). Returns at once when
        the core takes work, or cannot come back by itself (``stuck``), or
        the server drains; the submit after it then meets what is left."""
        if not self.failed or self._failure is not CoreRestarting or self.stuck:
            return
        limit = self.config.limits.max_queued_requests
        if limit > 0 and self.queued + self.held + samples > limit:
            raise QueueFull(
                f"the server is overloaded: {self.queued + self.held} requests wait, the limit "
                f"(--max-queued-requests) is {limit}; retry later"
            )
        self.held += samples
        try:
            with contextlib.suppress(TimeoutError):
                timeout_s = self.config.engine.worker_recovery_timeout_s
                await asyncio.wait_for(self._wake.wait(), timeout_s)
        finally:
            self.held -= samples

    def stop_holding(self) -> None:
        """The server drains: calls waiting for a restarting core go now."""
        self._holding = False
        self._wake.set()

    def fail_pending(self, error: CoreUnavailable) -> None:
        for fut in [*self._flushes.values(), *self._adapter_ops.values()]:
            if not fut.done():
                fut.set_exception(error)
        self._flushes.clear()
        self._adapter_ops.clear()

    def _cache_gone(self) -> None:
        """The core's radix cache went with it: KV event subscribers (a
        cache-aware router) hear so, and no stale load is reported."""
        last, self.load = self.load, None
        if last is None:
            return
        idle = dataclasses.replace(last, running=0, waiting=0, used_tokens=0, tracked=0)
        for listener in self._event_listeners:
            listener([AllBlocksCleared()], idle)

    def on_change(self, listener: Callable[[], None]) -> None:
        """``listener()`` whenever the core goes down or comes back up."""
        self._change_listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._change_listeners:
            listener()

    def error(self) -> CoreUnavailable:
        """What a call meets while the core cannot take work."""
        return self._failure(self.failed or "the core process failed")

    def _send(self, msg: object) -> None:
        if self.failed:
            raise self.error()
        self._pipe.send(msg)

    # ------------------------------------------------------------- inbox
    def dispatch(self, msg: object) -> None:
        """One message of the current core (the supervisor handles Ready and Failed)."""
        if isinstance(msg, ipc.Outputs):
            self._route(msg)
            self.load = msg.load
            for listener in self._event_listeners:
                listener(msg.events, msg.load)
            for listener in self._load_listeners:
                listener(msg.load)
        elif isinstance(msg, ipc.Rejected):
            call = self._calls.get(msg.rid)
            if call is not None:
                call.queue.put_nowait(msg)
                self._started(call, msg.rid)
        elif isinstance(msg, ipc.Flushed):
            fut = self._flushes.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ipc.AdapterReply):
            self.adapters = msg.adapters
            fut = self._adapter_ops.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ipc.Unavailable):
            self._unavailable(msg)

    def _route(self, msg: ipc.Outputs) -> None:
        """Each delta to its call's inbox. The column form's one-token deltas
        go as token news (inbox.py), never built into DeltaOuts: at batch
        256 this runs for every token streamed."""
        calls = self._calls
        if not msg.rids:
            for d in msg.deltas:
                call = calls.get(d.rid)
                if call is not None:
                    call.queue.put_nowait(d)
                    if call.unstarted:
                        self._started(call, d.rid)
            return
        others = iter(msg.deltas).__next__
        get = calls.get
        for rid, token, cached in zip(msg.rids, msg.tokens, msg.cached, strict=True):
            if token is None:
                item = others()
                call = get(item.rid)
                if call is not None:
                    call.queue.put_nowait(item)
                    if call.unstarted:
                        self._started(call, item.rid)
                continue
            call = get(rid)
            if call is not None:
                call.queue.put_news(rid, token, cached)
                if call.unstarted:
                    self._started(call, rid)

    def _unavailable(self, msg: ipc.Unavailable) -> None:
        """The worker group stayed lost too long: these calls end with
        UNAVAILABLE, the service itself lives on (unlike down)."""
        ended: set[int] = set()
        for rid in msg.rids:
            call = self._calls.get(rid)
            if call is None:
                continue
            self._started(call, rid)
            if id(call) not in ended:
                ended.add(id(call))
                call.queue.put_nowait(CoreUnavailable(msg.message))

    # ------------------------------------------------------------ requests
    def submit(self, samples: list[Submission], *, bounded: bool = True) -> Call:
        """Send one call's samples to the core, each under an internal rid
        (``Call``); ``bounded=False`` (health probes) skips
        --max-queued-requests and takes no place in it: a busy server must
        not look dead to its probes, nor refuse work for them."""
        public = [s.rid for s in samples]
        for rid in public:
            if rid in self._public:
                raise ValueError(f"request id {rid!r} is already in use")
        limit = self.config.limits.max_queued_requests
        if bounded and limit > 0 and self.queued + len(samples) > limit:
            self._make_room(samples[0].priority, self.queued + len(samples) - limit, limit)
        number = next(self._call_numbers)
        internal = {rid: f"{rid}#{number}" for rid in public}
        sent = [
            dataclasses.replace(
                s,
                rid=internal[s.rid],
                waits_for=None if s.waits_for is None else internal.get(s.waits_for, s.waits_for),
            )
            for s in samples
        ]
        call = Call([s.rid for s in sent], public, priority=samples[0].priority, number=number)
        for rid in public:
            self._public[rid] = call
        for rid in call.rids:
            self._calls[rid] = call
        if bounded:  # a probe takes no place in the queue (and is never evicted)
            call.unstarted.update(call.rids)
            self.queued += len(call.rids)
        try:
            self._send(ipc.Submit(sent))
        except Exception:
            self.forget(call)
            raise
        return call

    def _make_room(self, priority: int, needed: int, limit: int) -> None:
        """The queue is full and a call of ``priority`` needs ``needed`` more
        places. With priority scheduling, waiting calls of strictly lower
        priority give theirs up, the least preferred first and the newest
        among equals (SGLang's _abort_on_queued_limit), each ending with
        RESOURCE_EXHAUSTED and why; only if that makes room, else the
        newcomer is refused (QueueFull) and nobody is evicted."""
        refused = QueueFull(
            f"the server is overloaded: {self.queued} requests are queued, the limit "
            f"(--max-queued-requests) is {limit}; retry later"
        )
        sched = self.config.scheduler
        if not sched.enable_priority_scheduling:
            raise refused
        sign = sched.priority_sign
        waiting = {
            id(c): c
            for c in self._calls.values()
            if c.unstarted and c.priority * sign > priority * sign
        }
        victims: list[Call] = []
        least_first = sorted(
            waiting.values(), key=lambda c: (c.priority * sign, c.number), reverse=True
        )
        for call in least_first:
            if needed <= 0:
                break
            victims.append(call)
            needed -= len(call.unstarted)
        if needed > 0:
            raise refused
        for call in victims:
            self._evict(call, limit)

    def _evict(self, call: Call, limit: int) -> None:
        message = (
            f"evicted from the full queue by a request of higher priority (the limit "
            f"(--max-queued-requests) is {limit}); retry later"
        )
        logger.info(
            "request evicted by a higher-priority one",
            request_ids=call.public,
            priority=call.priority,
        )
        self.queued -= len(call.unstarted)
        call.unstarted.clear()
        call.queue.put_nowait(Evicted(message))
        self.abort(call.rids, message)

    def abort(self, rids: list[str], reason: str) -> None:
        if rids and not self.failed:
            self._send(ipc.Abort(rids, reason))

    def _started(self, call: Call, rid: str) -> None:
        if rid in call.unstarted:
            call.unstarted.discard(rid)
            self.queued -= 1

    def release(self, call: Call) -> None:
        """Free the call's public rids at once (it is being aborted): a new
        call may take them while this one's last outputs still come in."""
        for rid in call.public:
            if self._public.get(rid) is call:
                del self._public[rid]
        call.released.set()

    def forget(self, call: Call) -> None:
        self.release(call)
        self.queued -= len(call.unstarted)
        call.unstarted.clear()
        for rid in call.rids:
            if self._calls.get(rid) is call:
                del self._calls[rid]

    async def wait_free(self, public_rids: list[str], grace_s: float) -> None:
        """Wait up to ``grace_s`` for live calls holding these public rids to
        let them go. A client that cancels X and at once sends X again can
        be faster than the cancel's news reaching the old call's coroutine;
        a real duplicate is still refused (by ``submit``) after the grace."""
        deadline = asyncio.get_running_loop().time() + grace_s
        for rid in public_rids:
            call = self._public.get(rid)
            left = deadline - asyncio.get_running_loop().time()
            if call is not None and left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(call.released.wait(), left)

    def find(self, rid: str) -> Call | None:
        """The live call a public request id names (its own rid or its samples')."""
        call = self._public.get(rid)
        if call is not None:
            return call
        return next((c for r, c in self._public.items() if r.startswith(rid + "-")), None)

    @property
    def active_requests(self) -> int:
        """Samples whose outputs are still routed (aborted ones until their end)."""
        return len(self._calls)

    def end_calls(self, message: str) -> int:
        """End every call in flight with UNAVAILABLE and ``message`` (a drain
        that ran out of time); the core drops their requests. Returns how many."""
        calls = list({id(c): c for c in self._calls.values()}.values())
        for call in calls:
            call.queue.put_nowait(DrainEnded(message))
            with contextlib.suppress(CoreUnavailable, OSError):
                self.abort(call.rids, message)
        return len(calls)

    async def flush(self) -> ipc.Flushed:
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._flushes[token] = fut
        self._send(ipc.FlushCache(token))
        return await fut

    async def adapter_op(
        self, make: Callable[[int], object], while_down: bool = False
    ) -> ipc.AdapterReply:
        """Send a LoadAdapter or UnloadAdapter (``make(token)``) and wait for
        the core's answer. ``while_down``: a successor core being made ready
        (the supervisor restores the adapters before work is taken)."""
        if self._pipe is None or (self.failed and not while_down):
            raise self.error()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._adapter_ops[token] = fut
        try:
            self._pipe.send(make(token))
        except Exception:
            self._adapter_ops.pop(token, None)
            raise
        return await fut

    def adapter_ids(self) -> set[str]:
        return {a.lora_id for a in self.adapters}

    # ----------------------------------------------------------- listeners
    def on_events(self, listener: Callable[[list, ipc.Load], None]) -> Callable[[], None]:
        self._event_listeners.append(listener)
        return lambda: self._event_listeners.remove(listener)

    def on_load(self, listener: Callable[[ipc.Load], None]) -> Callable[[], None]:
        self._load_listeners.append(listener)
        return lambda: self._load_listeners.remove(listener)
