"""What the core asks of the engine's transfer machinery, and the figures
it reports (GetLoads' disagg section).

The engine reads ``Scheduler.disagg.take_orders()`` after every step and
update and answers each order with one of ``peer_ready`` (prefill unit),
``sent`` (prefill unit), ``received`` (decode unit) or ``failed`` (either).
An order's pages are the engine's to read (a send) or to fill (a receive)
from the moment it is handed over until the engine reports its end; the
core frees them only then, also when it gave up on the transfer itself
(a cancel: abort or timeout) or when the worker holding them is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.plan import TokenLogprobs


@dataclass(frozen=True, slots=True)
class KvSend:
    """Prefill unit: send the KV of prompt positions [prefix_len, prompt_len),
    page by page in ``pages`` (page i holds positions from prefix_len + i *
    page_size), and the first token's result to the decode unit that claimed
    ``room``. ``prefix_len`` is what that unit already had cached."""

    rid: str
    room: int
    pages: tuple[int, ...]
    prefix_len: int
    prompt_len: int
    first_token: int
    logprobs: TokenLogprobs | None
    cached_tokens: int  # the prompt tokens this unit read from its cache
    grammar_ended: bool = False


@dataclass(frozen=True, slots=True)
class KvReceive:
    """Decode unit: claim ``room`` and have its prefill unit write the KV of
    prompt positions [prefix_len, prompt_len) into ``pages`` (page i holds
    positions from prefix_len + i * page_size); ``prefix_len`` (page
    aligned) is what this unit has cached already and does not need sent."""

    rid: str
    room: int
    pages: tuple[int, ...]
    prefix_len: int
    prompt_len: int


@dataclass(slots=True)
class DisaggOrders:
    sends: list[KvSend] = field(default_factory=list)
    receives: list[KvReceive] = field(default_factory=list)
    # Transfers the core gave up on (the request was aborted or timed out):
    # stop them, then report each one's end (``failed``) so its pages can go.
    cancels: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.cancels)


@dataclass(frozen=True, slots=True)
class DisaggFigures:
    """The unit's role and its disaggregation queues (SGLang's
    DisaggregationMetrics: prefill_prealloc_queue_reqs is ``bootstrapping``,
    prefill_inflight_queue_reqs ``sending``, decode_prealloc_queue_reqs
    ``prealloc``, decode_transfer_queue_reqs ``receiving``)."""

    mode: str  # "prefill", "decode" or "null"
    bootstrapping: int = 0
    sending: int = 0
    prealloc: int = 0
    receiving: int = 0
    closing: int = 0  # finished requests whose pages wait for their transfer's end


__all__ = ["DisaggFigures", "DisaggOrders", "KvReceive", "KvSend"]
