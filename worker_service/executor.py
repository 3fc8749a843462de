"""Executes step plans in order: validation, per-request state, results.

The arithmetic is delegated to a ``Compute`` (the model, or the simulated
model); this module owns what a plan means: leaves before joins, pages
appended to tables, extends before decodes, each decode computing the
request's last sampled token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from worker_service.plan import Plan, PromptLogprobOut, Result
from worker_service.request_state import SlotState
from worker_service.validation import PlanError, validate_plan

logger = structlog.get_logger(__name__)


@dataclass(slots=True)
class SeqWork:
    """One request's share of a step."""

    slot: int
    state: SlotState
    start: int  # position of inputs[0]
    inputs: list[int]  # tokens computed this step (a decode: the last sampled one)
    sample: bool
    next_token: int | None = None  # prompt token after a chunk (prompt logprobs)


@dataclass(slots=True)
class ComputeOutput:
    # One entry per sampling SeqWork, in work order.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    ids_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobOut] = field(default_factory=list)


class Compute(Protocol):
    def run(self, work: list[SeqWork], num_extends: int) -> ComputeOutput: ...


class Executor:
    def __init__(
        self,
        compute: Compute,
        num_pages: int,
        page_size: int,
        vocab_size: int,
        max_context: int = 1 << 30,
    ) -> None:
        self.compute = compute
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_context = max_context  # positions the model can rotate
        self.slots: dict[int, SlotState] = {}

    def reset(self) -> None:
        """Drop every request (a new scheduler stream starts from nothing)."""
        self.slots.clear()

    def execute(self, plan: Plan) -> Result:
        t0 = time.perf_counter()
        try:
            validate_plan(
                plan, self.slots, self.num_pages, self.page_size, self.vocab_size, self.max_context
            )
        except PlanError as e:
            logger.warning("plan rejected", step_id=plan.step_id, error=str(e))
            return Result(plan.step_id, error=f"step {plan.step_id}: {e}")
        work = self._apply(plan)
        try:
            out = self.compute.run(work, len(plan.extends)) if work else ComputeOutput()
        except Exception as e:  # the KV cache may be half written: start over
            logger.exception("step failed; dropping all request state", step_id=plan.step_id)
            self.reset()
            return Result(plan.step_id, error=f"step {plan.step_id} failed on the worker: {e!r}")
        result = self._finish(plan.step_id, work, out)
        result.forward_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _apply(self, plan: Plan) -> list[SeqWork]:
        slots = self.slots
        for slot in plan.leaves:
            del slots[slot]
        for join in plan.joins:
            slots[join.slot] = SlotState.from_join(join)
        work: list[SeqWork] = []
        for e in plan.extends:
            state = slots[e.slot]
            state.pages.extend(e.new_pages)
            state.tokens.extend(e.input_ids)
            work.append(SeqWork(e.slot, state, e.start_pos, e.input_ids, e.sample, e.next_token))
        for slot, pos, new_page in zip(
            plan.decode_slots, plan.decode_positions, plan.decode_new_pages, strict=True
        ):
            state = slots[slot]
            if new_page:
                state.pages.append(new_page - 1)
            work.append(SeqWork(slot, state, pos, [state.tokens[-1]], True))
        return work

    def _finish(self, step_id: int, work: list[SeqWork], out: ComputeOutput) -> Result:
        result = Result(step_id)
        sampled = 0
        for w in work:
            w.state.kv_len = w.start + len(w.inputs)
            if not w.sample:
                continue
            token = out.token_ids[sampled]
            w.state.tokens.append(token)
            result.slots.append(w.slot)
            sampled += 1
        result.token_ids = out.token_ids
        result.logprobs = out.logprobs
        for ids, lps in zip(out.top_ids, out.top_logprobs, strict=True):
            result.top_counts.append(len(ids))
            result.top_ids.extend(ids)
            result.top_logprobs.extend(lps)
        for lps in out.ids_logprobs:
            result.ids_counts.append(len(lps))
            result.ids_logprobs.extend(lps)
        result.prompt_logprobs = out.prompt_logprobs
        return result
