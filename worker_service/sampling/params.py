"""A request's sampling and logprob options as the worker keeps them,
converted from the protocol's messages of the same names (execution/convert.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
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
    # require_reasoning: the grammar applies after this token (the end of the
    # thinking section) first appears in the output; None: from the first token.
    reasoning_end_token: int | None = None

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
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
