"""Transport-neutral step plans and results (the shape of the worker protocol).

The worker keeps per-request state between steps (page table, sampling
params, sequence so far, last sampled token), so a plan carries deltas only:

- ``joins``: requests the worker does not hold yet, with their parameters
  and the tokens before their first scheduled position (served from the
  prefix cache, so never sent as inputs);
- ``departures``: requests whose state the worker must drop (finished,
  aborted, retracted), applied before the joins;
- ``entries``: for each scheduled request, the tokens to compute from
  ``start_pos`` (``input_ids is None`` means "my last sampled token", which
  lets the scheduler send plan N+1 before result N arrives) and the page ids
  appended to its table.

Every position p the plan computes is written at slot p % page_size of page
table[p // page_size]. Prefill entries come before decode entries.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_service.core.sampling import LogprobOptions, SamplingParams


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # prefill (extend) entries only
    DECODE = "decode"  # one token per entry, all "last sampled"
    MIXED = "mixed"  # prefill chunk(s) and the decode batch in one forward
    IDLE = "idle"  # no forward: only joins/leaves to apply


@dataclass(frozen=True, slots=True)
class JoinRequest:
    rid: str
    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_len: int
    # Tokens [0, first start_pos): the cached prefix the worker will not see as
    # inputs. Together with inputs and samples it gives the whole sequence
    # (penalties, seeds and prompt logprobs need it).
    prefix_ids: list[int]
    # Output tokens already generated (a retracted request resuming): they sit
    # at positions >= prompt_len and count for penalties and seeded sampling.
    num_output_tokens: int = 0
    # (traceparent, tracestate) of a traced request: its step spans link to it.
    trace_context: tuple[str, str] | None = None
    # The adapter slot the request runs with (0: the base model).
    adapter_slot: int = 0


@dataclass(slots=True)
class ScheduledRequest:
    rid: str
    start_pos: int
    input_ids: list[int] | None  # None: the last token the worker sampled for it
    # Page ids appended to the request's table: a list, or a slice of the
    # request's packed page table (array('i')) for a prefill.
    new_pages: Sequence[int]
    sample: bool  # False for a prefill chunk that does not reach the end
    # The prompt token right after a chunk that stops inside the prompt, sent
    # when prompt logprobs are wanted so the chunk's last logits can score it.
    next_token: int | None = None
    # Speculative decoding: the last draft_len input_ids are drafted tokens
    # (input_ids[0] is the last sampled token); the worker verifies them and
    # answers 1..draft_len + 1 tokens (RequestOutput.more_tokens).
    draft_len: int = 0

    @property
    def num_tokens(self) -> int:
        return 1 if self.input_ids is None else len(self.input_ids)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    mode: ForwardMode
    entries: list[ScheduledRequest] = field(default_factory=list)
    joins: list[JoinRequest] = field(default_factory=list)
    departures: list[str] = field(default_factory=list)
    # (slot, lora_id) adapter slot assignments, applied after the departures
    # and before the joins.
    adapter_slots: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob payload the worker returns for one position (all optional)."""

    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    ids: list[int] | None = None  # the requested token_ids_logprob
    ids_logprobs: list[float] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one entry of a plan produced."""

    rid: str
    token_id: int | None  # None for a prefill chunk that did not sample
    logprobs: TokenLogprobs | None = None
    # Prompt logprobs computed in this step, when the request asked for them:
    # entry i is for the prompt token at position prompt_logprobs_start + i.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    # The token completed the request's grammar: nothing more can follow.
    grammar_ended: bool = False
    # A drafted entry's tokens after token_id (accepted drafts and the sample
    # after them), with their logprobs when asked (same length); None: none.
    more_tokens: list[int] | None = None
    more_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[RequestOutput] = field(default_factory=list)
    forward_ms: float = 0.0
    # Time the worker spent waiting for this plan after finishing the last one.
    idle_ms: float = 0.0
