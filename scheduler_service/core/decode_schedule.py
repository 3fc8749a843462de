"""Decode scheduling, the parts the Scheduler delegates: the decode rows of
a step (plain, or drafted when the step drafts), the new-token ratio after
requests were retracted for lack of pages (or its decay when none were), a
prefilled request joining the decode batch, and the in-flight record of a
step's decodes (oom_aborts.py has the aborts when pages cannot be found)."""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from scheduler_service.core.batch import RunningBatch
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.inflight import InFlight
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.outputs import SchedulerStats
from scheduler_service.core.plan import ScheduledRequest, StepPlan
from scheduler_service.core.request import Request, RequestState
from scheduler_service.core.spec.drafts import Drafter
from scheduler_service.core.spec.rows import Drafts, DraftWatch, plan_decode_rows
from scheduler_service.core.spec.state import SpecState

logger = structlog.get_logger(__name__)


def decode_rows(
    running: RunningBatch,
    kv: KvManager,
    reqs: list[Request],
    drafter: Drafter | None,
    step_id: int,
    context_len: int,
) -> tuple[list[ScheduledRequest], Drafts]:
    """Entries for ``reqs`` (their plain decode fits): drafted when
    ``drafter`` is given (the step drafts), else decodes."""
    if drafter is None:
        return running.prepare_decode(reqs), {}
    return plan_decode_rows(running, kv, reqs, drafter, step_id, context_len)


def next_new_token_ratio(
    cfg: SchedulerConfig, ratio: float, running: RunningBatch, retracted: int
) -> float:
    """After ``retracted`` requests gave up their KV to fit a decode, the
    ratio rises to what the batch left is estimated to need; else it decays."""
    if not retracted:
        return max(ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio)
    reqs = running.reqs()
    decoded = sum(len(r.output_ids) for r in reqs)
    budget = sum(r.sampling.max_new_tokens for r in reqs)
    estimate = min(1.0, (decoded + cfg.retract_decode_steps * len(reqs)) / max(budget, 1))
    ratio = max(ratio, estimate)
    logger.info(
        "retracted requests to fit decode",
        retracted=retracted,
        running=len(reqs),
        new_token_ratio=round(ratio, 3),
    )
    return ratio


def start_decoding(
    req: Request,
    running: RunningBatch,
    drafter: Drafter | None,
    watch: DraftWatch | None,
    max_draft: int,
) -> None:
    """``req``'s prefill is done and it samples: from now on it decodes (and
    drafts, if it asked to and speculation is on)."""
    req.move_to(RequestState.DECODING)
    req.pending = 1
    running.merge([req])
    if (
        req.spec is None
        and drafter is not None
        and req.speculative
        and req.sampling.grammar is None
    ):
        req.spec = SpecState(max_draft)
    if req.spec is not None and watch is not None:
        watch.add(req)


def expect_decodes(
    record: InFlight,
    plan: StepPlan,
    decode_entries: list[ScheduledRequest],
    drafts: Drafts,
    requests: Mapping[str, Request],
    stats: SchedulerStats,
) -> None:
    """Note in ``record`` the tokens ``plan``'s decode entries will bring."""
    entries = record.entries
    for e in decode_entries:
        req = requests[e.rid]
        entries[e.rid] = (req, req.epoch, True)
    record.expected_tokens += len(decode_entries)
    if drafts:
        # Drafted extends go with the extends, before the decodes.
        plan.entries.sort(key=lambda e: e.input_ids is None)
        record.drafts = drafts
        stats.spec_steps += 1
        stats.spec_rows += len(drafts)
