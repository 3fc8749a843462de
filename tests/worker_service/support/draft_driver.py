"""A hand-made scheduler for one request at a time, for speculative decoding
tests: it joins and prefills a prompt, then decodes it step by step, each
step either a plain decode or a drafted extend (the request's last sampled
token followed by drafts), and keeps what the results carry per token. After
a drafted step it frees the pages past ceil(kv_len / page_size) at once, to
the front of its free list, so the next pages it hands out are those (stale
KV of rejected drafts included), as the scheduler's pool may do. A runner
with two KV pools (sliding-window layers) gets a sliding page beside every
page, from a free list of its own handled alike (none freed by the window:
the requests here are short)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan, Result
from worker_service.sampling.params import LogprobOptions, SamplingParams


@dataclass
class Decoded:
    slot: int
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # tokens per step

    @property
    def last(self) -> int:
        return self.outputs[-1]


class DraftDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.page_size = runner.page_size
        self.free = list(range(runner.num_pages - 1, -1, -1))  # pop() takes the end
        self.two_pools = runner.num_swa_pages > 0
        self.swa_free = list(range(runner.num_swa_pages - 1, 0, -1))  # 0: the null page
        self.step_id = 0

    def new_plan(self) -> Plan:
        self.step_id += 1
        return Plan(self.step_id, ForwardMode.MIXED)

    def _pages_to(self, seq: Decoded, end: int) -> list[int]:
        new = [self.free.pop() for _ in range(-(-end // self.page_size) - len(seq.pages))]
        seq.pages += new
        seq.swa_pages += [self.swa_free.pop() for _ in new] if self.two_pools else []
        return new

    def _swa(self, seq: Decoded, new: list[int]) -> list[int]:
        """The sliding twins of the pages ``_pages_to`` just gave (two pools)."""
        return seq.swa_pages[len(seq.swa_pages) - len(new) :] if self.two_pools else []

    def start(
        self,
        slot: int,
        prompt: list[int],
        sampling: SamplingParams,
        logprobs: LogprobOptions = LogprobOptions(),  # noqa: B008 (frozen)
    ) -> Decoded:
        """Join and prefill: the first output token."""
        seq = Decoded(slot, list(prompt))
        plan = self.new_plan()
        plan.joins.append(Join(slot, f"r{slot}", sampling, logprobs, len(prompt), []))
        new = self._pages_to(seq, len(prompt))
        extend = Extend(slot, 0, seq.prompt, new, True, new_swa_pages=self._swa(seq, new))
        plan.extends.append(extend)
        seq.kv_len = len(prompt)
        self.take(seq, self.run(plan))
        return seq

    def decode_plan(self, seq: Decoded) -> Plan:
        plan = self.new_plan()
        new = self._pages_to(seq, seq.kv_len + 1)
        plan.decode_slots.append(seq.slot)
        plan.decode_positions.append(seq.kv_len)
        plan.decode_new_pages.append(new[0] + 1 if new else 0)
        if self.two_pools:
            plan.decode_new_swa_pages.append(self._swa(seq, new)[0] + 1 if new else 0)
        return plan

    def drafted_plan(self, seq: Decoded, drafts: list[int], last: int | None = None) -> Plan:
        """``last``: the last sampled token (default: the last output taken)."""
        plan = self.new_plan()
        end = seq.kv_len + 1 + len(drafts)
        new = self._pages_to(seq, end)
        last = seq.last if last is None else last
        drafted = Extend(seq.slot, seq.kv_len, [last, *drafts], new, True, draft_len=len(drafts))
        drafted.new_swa_pages = self._swa(seq, new)
        plan.extends.append(drafted)
        return plan

    def run(self, plan: Plan) -> Result:
        result = self.runner.execute(plan)
        assert not result.error, result.error
        return result

    def decode(self, seq: Decoded) -> list[int]:
        return self.take(seq, self.run(self.decode_plan(seq)))

    def verify(self, seq: Decoded, drafts: list[int]) -> list[int]:
        return self.take(seq, self.run(self.drafted_plan(seq, drafts)))

    def take(self, seq: Decoded, result: Result) -> list[int]:
        """The step's tokens for ``seq`` (its only entry); KV and pages follow."""
        assert result.slots == [seq.slot]
        count = result.token_counts[0] if result.token_counts else 1
        assert len(result.token_ids) == len(result.logprobs) == count
        tokens = result.token_ids
        seq.outputs += tokens
        seq.logprobs += result.logprobs
        seq.counts.append(count)
        at = 0
        for n in result.top_counts:
            seq.top_ids.append(result.top_ids[at : at + n])
            seq.top_logprobs.append(result.top_logprobs[at : at + n])
            at += n
        seq.kv_len = len(seq.prompt) + len(seq.outputs) - 1  # the last one is not computed
        if result.token_counts:  # a drafted step: the pages past the KV are free
            keep = -(-seq.kv_len // self.page_size)
            self.free += reversed(seq.pages[keep:])  # handed out again first
            del seq.pages[keep:]
            self.swa_free += reversed(seq.swa_pages[keep:])
            del seq.swa_pages[keep:]
        return tokens
