"""Fenced scheduler sessions: who may own the worker's request state.

An Execute stream takes the worker over only with a well-formed opening
message (``StepPlan.session``: a session id and an epoch, nothing else) whose
epoch is above every epoch this worker has accepted. Anything else is refused
before the active session is touched: a stream that sends garbage or no
opening gets INVALID_ARGUMENT, a stale scheduler (an epoch not above the
highest seen, e.g. one that was paused while a newer one took over)
FAILED_PRECONDITION. The epoch only grows, so a scheduler fenced out once
stays out; a restarted scheduler opens above the highest epoch (it reads it
from GetInfo) and takes over at once.

Because the highest epoch only grows, one opening near the top of the range
would fence out every later scheduler until the worker restarts. So an epoch
must lie in [1, MAX_SESSION_EPOCH] and be at most MAX_EPOCH_LEAD_NS above
max(this worker's clock in ns, the highest epoch it accepted): a scheduler's
epoch is its clock, or just above the highest epoch the workers report, so it
is always accepted unless the two clocks disagree by more than the lead,
while a stranger's openings can push the highest epoch up by at most the lead
each (some 7 million of them to exhaust the range).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.session_epoch import MAX_SESSION_EPOCH, MAX_SESSION_EPOCH_TEXT
from protos import worker_pb2 as pb
from worker_service.rpc.request_decoding import Undecodable

MAX_SESSION_ID = 256
# How far an opening's epoch may lead the worker's clock and its highest
# epoch: about 18.3 minutes of clock difference between scheduler and worker.
MAX_EPOCH_LEAD_NS = 1 << 40
_LEAD_TEXT = f"2**40 ns ({MAX_EPOCH_LEAD_NS / 60e9:.1f} min)"
STEP_PLAN = pb.StepPlan.DESCRIPTOR.full_name


class SessionRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Session:
    session_id: str
    epoch: int
    peer: str


def parse_plan(data: bytes) -> pb.StepPlan | Undecodable:
    """Execute's request deserializer: garbage becomes a value the servicer
    refuses with a clear status (gRPC's own would be INTERNAL)."""
    try:
        return pb.StepPlan.FromString(data)
    except Exception as e:  # protobuf's DecodeError and friends
        return Undecodable("Execute", STEP_PLAN, f"{type(e).__name__}: {e}", len(data))


def _opening(msg: object) -> Session:
    if isinstance(msg, Undecodable):
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the opening message of an Execute stream: {msg.details()}",
        )
    if not isinstance(msg, pb.StepPlan) or not msg.HasField("session"):
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "an Execute stream must open with StepPlan.session (session id and epoch)",
        )
    extra = [f.name for f, _ in msg.ListFields() if f.name not in ("session", "step_id")]
    if extra:
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the opening message carries {', '.join(extra)}: it must hold the session only",
        )
    s = msg.session
    if not s.session_id or len(s.session_id) > MAX_SESSION_ID:
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the opening message needs a session id of 1-{MAX_SESSION_ID} characters",
        )
    if s.epoch == 0:
        raise SessionRefused(grpc.StatusCode.INVALID_ARGUMENT, "the session epoch must be > 0")
    if s.epoch > MAX_SESSION_EPOCH:
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"session epoch {s.epoch} is above the protocol's maximum {MAX_SESSION_EPOCH_TEXT}",
        )
    return Session(s.session_id, s.epoch, "")


class SessionFence:
    """The highest epoch accepted and the session that holds the worker. Not
    locked: the servicer calls ``take`` under its step lock. ``clock``: the
    worker's wall clock in ns (the epoch lead is measured from it)."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self.highest_epoch = 0
        self.owner: Session | None = None
        self._clock = clock

    def check(self, msg: object) -> Session:
        """The session ``msg`` opens, or SessionRefused; changes nothing."""
        session = _opening(msg)
        if session.epoch <= self.highest_epoch:
            owner = self.owner
            held = f" (held by session {owner.session_id})" if owner is not None else ""
            raise SessionRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale scheduler session {session.session_id}: epoch {session.epoch} is not "
                f"above {self.highest_epoch}, which this worker has accepted{held}",
            )
        base = max(self._clock(), self.highest_epoch)
        if session.epoch - base > MAX_EPOCH_LEAD_NS:
            raise SessionRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"session epoch {session.epoch} is more than {_LEAD_TEXT} ahead of {base}, "
                "the later of this worker's clock (ns) and the highest epoch it accepted: a "
                "scheduler's epoch is its clock or just above the workers' highest, so either "
                "its clock is that far ahead of this worker's or the epoch is not a scheduler's",
            )
        return session

    def take(self, msg: object, peer: str) -> Session:
        """Check ``msg`` again (another stream may have won meanwhile) and
        make its session the owner."""
        session = self.check(msg)
        self.highest_epoch = session.epoch
        self.owner = Session(session.session_id, session.epoch, peer)
        return self.owner
