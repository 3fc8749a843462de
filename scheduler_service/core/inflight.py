"""What the scheduler remembers of a plan until its result comes back."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core.request import Request


class ProtocolError(RuntimeError):
    """A step result that does not fit the plan it answers."""


@dataclass(slots=True)
class InFlight:
    step_id: int
    # rid -> (request, its epoch when planned, whether the entry samples)
    entries: dict[str, tuple[Request, int, bool]]
    expected_tokens: int
    # Requests whose prefill completes in this step without sampling
    # (max_new_tokens == 0): they finish when the step's result arrives.
    prefill_only: list[tuple[Request, int]] = field(default_factory=list)
    # Drafted extends (speculative decoding): rid -> (request, epoch, start_pos,
    # drafts). While such a plan is in flight nothing else is planned.
    drafts: dict[str, tuple[Request, int, int, list[int]]] = field(default_factory=dict)


def take_answered(inflight: deque[InFlight], step_id: int) -> InFlight:
    """The oldest plan in flight, which a result for ``step_id`` must answer
    (ProtocolError if it answers another)."""
    if not inflight or inflight[0].step_id != step_id:
        expected = inflight[0].step_id if inflight else None
        raise ProtocolError(f"result for step {step_id}, expected step {expected}")
    return inflight.popleft()
