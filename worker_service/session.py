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
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protos import worker_pb2 as pb

MAX_SESSION_ID = 256


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


class Undecodable:
    """A message on the Execute stream that does not parse as a StepPlan."""

    def __init__(self, error: str) -> None:
        self.error = error


def parse_plan(data: bytes) -> pb.StepPlan | Undecodable:
    """Execute's request deserializer: garbage becomes a value the servicer
    refuses with a clear status (gRPC's own would be INTERNAL)."""
    try:
        return pb.StepPlan.FromString(data)
    except Exception as e:  # protobuf's DecodeError and friends
        return Undecodable(f"{type(e).__name__}: {e}")


def _opening(msg: object) -> Session:
    if isinstance(msg, Undecodable):
        raise SessionRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the opening message of an Execute stream does not parse as a StepPlan ({msg.error})",
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
    return Session(s.session_id, s.epoch, "")


class SessionFence:
    """The highest epoch accepted and the session that holds the worker. Not
    locked: the servicer calls ``take`` under its step lock."""

    def __init__(self) -> None:
        self.highest_epoch = 0
        self.owner: Session | None = None

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
        return session

    def take(self, msg: object, peer: str) -> Session:
        """Check ``msg`` again (another stream may have won meanwhile) and
        make its session the owner."""
        session = self.check(msg)
        self.highest_epoch = session.epoch
        self.owner = Session(session.session_id, session.epoch, peer)
        return self.owner
