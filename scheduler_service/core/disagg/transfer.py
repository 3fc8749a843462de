"""Transfer: one disaggregated request's record, from its announcement until
its transfer ends (and the checks a newly announced request must pass)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling import InvalidRequestError

NEVER = float("inf")
# The status a request ends with when its transfer fails or times out: the
# peer or the path between the units is unavailable; retry elsewhere.
TRANSFER_FAILED = "UNAVAILABLE"


@dataclass(slots=True, eq=False)
class Transfer:
    req: Request
    room: int
    # When the request gives up on its peer (the bootstrap timeout while the
    # peer has not claimed its room, the waiting timeout while its transfer
    # runs); NEVER while it computes on this unit.
    deadline: float
    # The decode unit's cached prefix (page aligned): what is not sent. A
    # prefill unit learns it when the decode unit claims the room.
    prefix_len: int = 0
    # The engine holds the request's pages: its order was handed over and
    # the engine has not reported the transfer's end.
    engine_holds: bool = False
    # Prefill unit: why the first token finished the request (reported to
    # the client once the decode unit has acknowledged the KV).
    reason: FinishReason | None = None
    # Decode unit: the newest plan in flight when its pages were allocated:
    # its receive order waits until that plan is answered (a page freed
    # while that plan was built may still be written by it).
    fence: int = 0
    received: bool = False  # decode unit: the KV and the first token landed


def check_announced(req: Request, rooms: dict[int, Transfer]) -> None:
    """InvalidRequestError if ``req`` cannot be served disaggregated."""
    room = req.bootstrap.room
    if room in rooms:
        raise InvalidRequestError(
            f"request {req.rid}: bootstrap room {room} is in use by request {rooms[room].req.rid}"
        )
    if req.sampling.max_new_tokens < 1 or req.embed is not None:
        raise InvalidRequestError(
            f"request {req.rid}: a disaggregated request must generate (max_new_tokens >= 1)"
        )
    if req.adapter is not None:
        raise InvalidRequestError(
            f"request {req.rid}: LoRA adapters are not served disaggregated yet"
        )


def prefill_sampling(req: Request) -> None:
    """A prefill unit samples the first token only (SGLang's max_new_tokens
    = 1, which keeps admission's estimate exact); min_new_tokens keeps its
    effect on that token."""
    sp = req.sampling
    req.sampling = dataclasses.replace(
        sp, max_new_tokens=1, min_new_tokens=min(sp.min_new_tokens, 1)
    )


__all__ = ["NEVER", "TRANSFER_FAILED", "Transfer", "check_announced", "prefill_sampling"]
