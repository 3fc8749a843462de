"""Prefill admission: which waiting requests run this step, and how far.

``plan_admission`` walks the (already ordered) waiting queue through a
``PrefillAdder`` and returns a ``PrefillDecision``; it moves no request.
The scheduler applies the decision through the request table. What
admission does touch is resource bookkeeping: it locks matched prefixes and
attaches them to the admitted requests' tables, it releases the KV of the
running requests it preempts at once (the pages they free count for the
requests admitted after them in the same step), and an admitted request of
a LoRA adapter takes its adapter slot at once (later requests of the same
step see it taken).

With the file tier (kv/storage_tier.py) a request whose prefetch from the
files is out is passed over (it waits, others are admitted), and a step
that passed one over is not stuck.

``unfit_head`` is the last word when admission is stuck: the request first
in line that cannot fit even in an empty pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.admission.adder import AddResult, PrefillAdder
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.ids import zero_pages
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import OUT_OF_CAPACITY, FinishAbort, Request

logger = structlog.get_logger(__name__)


@dataclass(slots=True)
class PrefillDecision:
    """What one step's admission decided, for the scheduler to apply."""

    # (request, end of the positions it computes this step), in plan order:
    # the chunked request continuing first, then the newly admitted ones.
    admitted: list[tuple[Request, int]] = field(default_factory=list)
    # The request whose prefill continues next step (None: none).
    chunked: Request | None = None
    # Running requests preempted for higher-priority ones; their KV is
    # already released, they go back to wait.
    preempted: list[Request] = field(default_factory=list)
    # Nothing runs and nothing was admitted: the request first in line cannot
    # fit even in an empty pool (an idle scheduler admits whatever fits).
    stuck: bool = False
    # Prompt tokens the admitted requests found in the cache.


class _InBatchPrefixes:
    """The prompts admitted in this step, so that a request sharing a long
    uncached prefix with one of them can wait a step and then find it cached
    (``SchedulerConfig.prefix_hold_tokens``)."""

    def __init__(self, hold_tokens: int, admitted: list[tuple[Request, int]]) -> None:
        self.hold = hold_tokens
        self.tree: RadixCache | None = None
        for req, _ in admitted:
            self.add(req)

    def add(self, req: Request) -> None:
        if not self.hold:
            return
        if self.tree is None:
            self.tree = RadixCache(page_size=1)
        tokens = req.token_array()
        self.tree.insert(tokens, zero_pages(len(tokens)), req.extra_key)

    def should_wait(self, req: Request) -> bool:
        if self.tree is None:  # nothing admitted yet (or holding is off)
            return False
        shared = self.tree.match(req.token_array(), req.extra_key, touch=False).length
        return shared - req.match_len >= self.hold


def match_prefix(cache: RadixCache, req: Request) -> None:
    """Record in ``req.match_*`` the longest cached prefix it may use."""
    m = cache.match(req.token_array(), req.extra_key, limit=req.max_prefix_len())
    req.match_pages, req.match_len, req.match_node = m.pages, m.length, m.node
    req.match_swa = m.swa
    req.match_host_len, req.match_host_node = m.host_len, m.host_node


def plan_admission(
    config: SchedulerConfig,
    kv: KvManager,
    waiting: list[Request],
    running: list[Request],
    *,
    chunked: Request | None,
    new_token_ratio: float,
    mixed_tokens: int,
    adapters: AdapterSlots | None = None,
    reserved: Sequence[Request] = (),
) -> PrefillDecision:
    """Admit from ``waiting`` (in the order given) under the step's budgets.
    A request of a LoRA adapter is admitted only if the adapter has or can get
    one of the worker's adapter slots; it takes the slot at once, so later
    requests of the same step see it taken. ``reserved``: requests that will
    join the decode batch unadmitted (PrefillAdder), counted against
    ``max_running_requests`` too."""
    priority = config.enable_priority_scheduling
    adder = PrefillAdder(
        config, kv, running, new_token_ratio, mixed_decode_tokens=mixed_tokens, reserved=reserved
    )
    if chunked is not None:
        result = adder.add_chunked_req(chunked)
        if not adder.admitted:
            # First in line and out of memory: nobody overtakes it.
            return PrefillDecision(chunked=chunked, stuck=adder.nothing_running)
    else:
        result = AddResult.CONTINUE
    prefetching = False  # a request waits for its prefetch from the file tier
    if result is AddResult.CONTINUE:
        held = _InBatchPrefixes(config.prefix_hold_tokens, adder.admitted)
        storage = kv.cache.storage
        room = config.max_running_requests - len(running) - len(reserved)
        for req in waiting:
            full = len(adder.admitted) >= room + len(adder.preempted)
            if full and not (priority and adder.preempt_to_schedule(req, running)):
                break
            needs_slot = req.adapter is not None and not req.adapter_slot
            if needs_slot and (adapters is None or not adapters.can_acquire(req.adapter)):
                continue  # its adapter finds no slot this step: the next may
            match_prefix(kv.cache, req)
            if storage is not None and kv.cache.storage_hold(req):
                prefetching = True
                continue
            if held.should_wait(req):
                continue
            result = adder.add_one_req(req)
            taken = bool(adder.admitted) and adder.admitted[-1][0] is req
            if taken:
                held.add(req)
            if (
                not taken
                and result is AddResult.NO_TOKEN
                and priority
                and adder.preempt_to_schedule(req, running)
            ):
                match_prefix(kv.cache, req)
                result = adder.add_one_req(req)
                taken = bool(adder.admitted) and adder.admitted[-1][0] is req
            if taken and needs_slot:
                req.adapter_slot = adapters.acquire(req.adapter)
            if result is not AddResult.CONTINUE:
                break
    return PrefillDecision(
        admitted=adder.admitted,
        chunked=adder.new_chunked,
        preempted=adder.preempted,
        # An idle scheduler admits whatever fits; if it admitted nothing (and
        # passed nobody over for a prefetch), the request first in line can
        # never fit.
        stuck=adder.nothing_running and not adder.admitted and not prefetching,
    )


def unfit_head(
    chunked: Request | None, waiting: list[Request], pool: PagePool
) -> tuple[Request, FinishAbort] | None:
    """When nothing runs and nothing is in flight, yet nothing was admitted:
    an idle scheduler admits any request that fits, so the one first in line
    cannot fit even in an empty pool (a retracted request that grew), and
    waiting longer cannot help. That request and why it is aborted."""
    head = chunked if chunked is not None else (waiting or [None])[0]
    if head is None:
        return None
    capacity = pool.num_pages * pool.page_size
    logger.warning(
        "request does not fit the KV pool",
        request_id=head.rid,
        trace_id=head.trace_id,
        tokens=head.num_tokens,
    )
    return head, FinishAbort(
        f"out of memory: the request needs {head.num_tokens + 1} tokens of KV cache "
        f"and the pool holds {capacity}",
        OUT_OF_CAPACITY,
    )
