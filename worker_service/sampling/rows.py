"""What a step samples from (one ``SampleRow`` per sampling request) and what it
gives back (``SampleOutput``): the sampler's input and the model step's output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker_service.sampling.grammar import GrammarState
from worker_service.sampling.params import LogprobOptions, SamplingParams


@dataclass(slots=True)
class PromptLogprobs:
    slot: int
    start: int
    logprobs: list[float]  # NaN for position 0
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    ids_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class PooledEmbedding:
    """An embedding request's vector: its prompt's pooled final-norm hidden state."""

    slot: int
    values: list[float]


@dataclass
class SampleRow:
    """One request that samples this step."""

    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_ids: Sequence[int]  # the prompt (repetition penalty)
    output_ids: Sequence[int]  # generated so far (penalties)
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids
    # How many tokens were generated so far (min_new_tokens, seeded draws);
    # None: len(output_ids). Lets a caller skip building the id lists of rows
    # without penalties.
    num_outputs: int | None = None
    # Structured generation: the tokens the request's grammar allows next.
    grammar: GrammarState | None = None

    @property
    def output_count(self) -> int:
        return len(self.output_ids) if self.num_outputs is None else self.num_outputs


@dataclass(slots=True)
class SampleOutput:
    """Per sampling row, in the order of the rows given to ``Sampler.sample``
    (in a step: the order of the sampling ``SeqWork``).

    ``logprobs`` always holds the chosen token's raw logprob (it costs one
    logsumexp); ``top_*`` hold ``top_logprobs_num`` entries and ``ids_logprobs``
    one entry per ``token_ids_logprob`` id (NaN for an id outside the
    vocabulary), empty lists for rows that did not ask. ``prompt_logprobs``
    (one entry per request whose prompt chunk was scored this step) is filled
    by the model step, never by the sampler.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    ids_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Embedding requests whose prompt this step finished (the model step's too).
    embeddings: list[PooledEmbedding] = field(default_factory=list)
    # Tokens per sampling entry once drafts are accepted (draft_acceptance.py);
    # empty: one row per entry.
    token_counts: list[int] = field(default_factory=list)
