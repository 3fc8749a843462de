"""A minimal stand-in scheduler for worker tests: builds step plans by hand.

It admits requests at given steps, prefills their prompts in chunks, serves
the start of a prompt from pages another request wrote earlier (a cached
prefix), mixes extends and decodes in one plan, and decodes greedily until
each request has its tokens; then it checks nothing else. The tests compare
what it collects with Hugging Face transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import AdapterSlot, Extend, ForwardMode, Join, Plan
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.rows import PromptLogprobs

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DriverRequest:
    prompt: list[int]
    max_new: int
    arrive: int = 0  # step at which it joins
    share_from: int | None = None  # index of an earlier request whose pages it reuses
    sampling: SamplingParams = GREEDY
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    adapter_slot: int = 0  # LoRA: 0 = base model
    # filled in while running
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    outputs: list[int] = field(default_factory=list)
    logprob_values: list[float] = field(default_factory=list)
    prompt_logprobs: dict[int, float] = field(default_factory=dict)
    top: list[list[int]] = field(default_factory=list)
    joined: bool = False
    done: bool = False


class PlanDriver:
    def __init__(self, runner: ModelRunner, page_size: int, chunk: int | None = None) -> None:
        self.runner = runner
        self.page_size = page_size
        self.chunk = chunk
        self.free = list(range(runner.num_pages - 1, -1, -1))
        self.step_id = 0

    def _pages_to(self, req: DriverRequest, kv_len: int) -> list[int]:
        need = -(-kv_len // self.page_size) - len(req.pages)
        new = [self.free.pop() for _ in range(need)]
        req.pages.extend(new)
        return new

    def run(
        self,
        reqs: list[DriverRequest],
        max_steps: int = 10_000,
        adapter_slots: list[AdapterSlot] | None = None,
    ) -> list[DriverRequest]:
        """``adapter_slots`` ride on the first plan that runs."""
        for i, r in enumerate(reqs):
            r.slot = i
        step = 0
        assign = list(adapter_slots or [])
        while not all(r.done for r in reqs):
            plan = Plan(self.step_id, ForwardMode.MIXED)
            decoding: list[DriverRequest] = []
            for r in reqs:
                if r.done or r.arrive > step:
                    continue
                if not r.joined:
                    self._join(r, reqs, plan)
                if r.kv_len < len(r.prompt):
                    self._extend(r, plan)
                elif r.outputs:
                    decoding.append(r)
            for r in decoding:
                plan.decode_slots.append(r.slot)
                plan.decode_positions.append(r.kv_len)
                new = self._pages_to(r, r.kv_len + 1)
                plan.decode_new_pages.append(new[0] + 1 if new else 0)
                r.kv_len += 1
            if plan.extends or plan.decode_slots:
                plan.adapter_slots, assign = assign, []
                self._apply(reqs, plan)
            step += 1
            self.step_id += 1
            assert step < max_steps
        return reqs

    def _join(self, r: DriverRequest, reqs: list[DriverRequest], plan: Plan) -> None:
        prefix: list[int] = []
        if r.share_from is not None:
            src = reqs[r.share_from]
            common = 0
            while (
                common < min(len(src.prompt), len(r.prompt) - 1)
                and src.prompt[common] == r.prompt[common]
            ):
                common += 1
            common = min(common, src.kv_len)
            n_pages = common // self.page_size
            r.pages = src.pages[:n_pages]  # read-only: full pages the source wrote
            r.kv_len = n_pages * self.page_size
            prefix = r.prompt[: r.kv_len]
        plan.joins.append(
            Join(
                r.slot,
                f"r{r.slot}",
                r.sampling,
                r.logprobs,
                len(r.prompt),
                prefix,
                adapter_slot=r.adapter_slot,
            )
        )
        r.joined = True

    def _extend(self, r: DriverRequest, plan: Plan) -> None:
        start = r.kv_len
        end = len(r.prompt) if self.chunk is None else min(len(r.prompt), start + self.chunk)
        known = len(r.pages) if plan.joins and plan.joins[-1].slot == r.slot else None
        new = self._pages_to(r, end)
        pages = r.pages[:known] + new if known is not None else new
        nxt = r.prompt[end] if end < len(r.prompt) else None
        plan.extends.append(
            Extend(r.slot, start, r.prompt[start:end], pages, end == len(r.prompt), nxt)
        )
        r.kv_len = end

    def _apply(self, reqs: list[DriverRequest], plan: Plan) -> None:
        result = self.runner.execute(plan)
        assert not result.error, result.error
        top_at = 0
        for i, slot in enumerate(result.slots):
            r = reqs[slot]
            r.outputs.append(result.token_ids[i])
            r.logprob_values.append(result.logprobs[i])
            n = result.top_counts[i] if result.top_counts else 0
            r.top.append(result.top_ids[top_at : top_at + n])
            top_at += n
            if len(r.outputs) >= r.max_new:
                r.done = True
                plan_leave = r.slot
                self._leave(plan_leave)
        for p in result.prompt_logprobs:
            self._take_prompt_logprobs(reqs[p.slot], p)

    def _leave(self, slot: int) -> None:
        """Leaves ride on the next plan; pages are not reused by this driver."""
        self.runner.execute(Plan(self.step_id + 100_000 + slot, ForwardMode.IDLE, leaves=[slot]))

    @staticmethod
    def _take_prompt_logprobs(r: DriverRequest, p: PromptLogprobs) -> None:
        for i, lp in enumerate(p.logprobs):
            r.prompt_logprobs[p.start + i] = lp
