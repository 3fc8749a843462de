"""Per-request generation parameters, with SGLang's defaults and range checks.

The scheduler only reads the length and stop fields; the rest travel to the
worker's sampler unchanged. Validation lives here so that every entry point
(gRPC API, tests, benchmarks) rejects the same bad input with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's stand-in for "no top-k limit" (top_k = -1 on the wire).
TOP_K_ALL = 1 << 30
# Temperatures below this are treated as greedy decoding, as in SGLang.
GREEDY_TEMPERATURE_EPS = 1e-6


GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")


class InvalidRequestError(ValueError):
    """A request parameter is out of range; the message says which and why."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_strs: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    # Structured generation: (kind, text), kind one of GRAMMAR_KINDS. The
    # worker masks every sampled token to what the grammar allows.
    grammar: tuple[str, str] | None = None
    # require_reasoning: the token that ends the output's thinking section (the
    # model's </think>). The worker applies the grammar only after it; the API
    # process counts the tokens up to it as reasoning_tokens. None: no section.
    reasoning_end_token: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def effective_top_k(self) -> int:
        """top_k as a sampler uses it: greedy is 1, "no limit" is TOP_K_ALL."""
        if self.is_greedy:
            return 1
        return TOP_K_ALL if self.top_k == -1 else self.top_k

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (
                self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})",
            ),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (all(self.stop_strs), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        if vocab_size is not None:
            for name, ids in (
                ("stop_token_ids", self.stop_token_ids),
                ("logit_bias", [tok for tok, _ in self.logit_bias]),
                (
                    "reasoning_end_token",
                    [] if self.reasoning_end_token is None else [self.reasoning_end_token],
                ),
            ):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise InvalidRequestError(
                        f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                    )


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What logprobs the client asked for (SGLang's return_logprob family).

    ``logprob_start_len`` is the first prompt position whose logprob is
    returned; -1 means output tokens only. Prompt positions at or after it are
    never served from the prefix cache, since their logits must be computed.
    """

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()

    def validate(self, prompt_len: int) -> None:
        if self.top_logprobs_num < 0:
            raise InvalidRequestError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise InvalidRequestError(
                f"logprob_start_len must be -1 or a prompt position, got {self.logprob_start_len}"
            )
        if self.logprob_start_len >= prompt_len:
            raise InvalidRequestError(
                f"logprob_start_len ({self.logprob_start_len}) must be < the prompt length "
                f"({prompt_len})"
            )

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def wants_next_token_row(self) -> bool:
        """Whether prefill-only scoring (max_new_tokens 0) owes the requested
        ids' logprobs at the position after the prompt, as the public proto
        promises though no token is generated."""
        return self.return_logprob and bool(self.token_ids_logprob)


DEFAULT_SAMPLING = SamplingParams()
NO_LOGPROBS = LogprobOptions()

__all__ = [
    "DEFAULT_SAMPLING",
    "GREEDY_TEMPERATURE_EPS",
    "NO_LOGPROBS",
    "TOP_K_ALL",
    "InvalidRequestError",
    "LogprobOptions",
    "SamplingParams",
]
