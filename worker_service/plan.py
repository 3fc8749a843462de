"""The worker's view of a step plan and its result (converted from and to the
protocol in convert.py, the only module that knows both)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Mode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float = 1.0  # < 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    grammar: tuple[str, str] | None = None  # (kind, text): structured generation

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class LogprobSpec:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()


@dataclass(slots=True)
class JoinSpec:
    slot: int
    rid: str
    sampling: SamplingSpec
    logprobs: LogprobSpec
    prompt_len: int
    prefix_ids: list[int]
    num_output_tokens: int = 0
    traceparent: str = ""
    tracestate: str = ""
    # 0: the base model; k >= 1: the adapter in adapter slot k when it joins
    # (the request keeps that adapter for its whole life on the worker).
    adapter_slot: int = 0


@dataclass(frozen=True, slots=True)
class AdapterSlotSpec:
    """Adapter slot ``slot`` (1..N) holds adapter ``name`` from this plan on;
    "" empties it."""

    slot: int
    name: str


@dataclass(slots=True)
class ExtendSpec:
    slot: int
    start_pos: int
    input_ids: list[int]
    new_pages: list[int]
    sample: bool
    next_token: int | None = None
    # Speculative decoding: the last draft_len input_ids are drafts to verify
    # (see ExtendSpec in protos/worker.proto).
    draft_len: int = 0


@dataclass(slots=True)
class Plan:
    step_id: int
    mode: Mode
    leaves: list[int] = field(default_factory=list)
    joins: list[JoinSpec] = field(default_factory=list)
    extends: list[ExtendSpec] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    # page appended to the slot's table, plus one; 0 = none
    decode_new_pages: list[int] = field(default_factory=list)
    # applied after the leaves, before the joins
    adapter_slots: list[AdapterSlotSpec] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobOut:
    slot: int
    start: int
    logprobs: list[float]  # NaN for position 0
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    ids_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    step_id: int
    error: str = ""
    slots: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_counts: list[int] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    ids_counts: list[int] = field(default_factory=list)
    ids_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobOut] = field(default_factory=list)
    forward_ms: float = 0.0
    idle_ms: float = 0.0
    grammar_ended: list[int] = field(default_factory=list)  # indices into token_ids
    # Tokens per sampling entry (drafted extends: 1..draft_len + 1); empty:
    # one each, and then the per-token lists are per entry.
    token_counts: list[int] = field(default_factory=list)
