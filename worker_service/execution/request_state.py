"""What the worker remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker_service.execution.plan import Join
from worker_service.sampling.grammar import GrammarState
from worker_service.sampling.params import LogprobOptions, SamplingParams

if TYPE_CHECKING:
    from worker_service.lora.store import LoadedAdapter


@dataclass(slots=True)
class SlotState:
    rid: str
    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_len: int
    # The whole sequence as far as the worker knows it: cached prefix, inputs
    # computed, and the last sampled token (whose KV is not computed yet).
    tokens: list[int]
    # Positions [0, kv_len) have their KV in the pages.
    kv_len: int
    pages: list[int] = field(default_factory=list)
    # The request's row of the worker's PageTable, which mirrors ``pages``
    # (and of the sliding table, which mirrors ``swa_pages``: the same row).
    row: int = -1
    # Two pools: the sliding layers' pages, as long as ``pages``; entries
    # before ``swa_live_from`` may be the null page 0 (freed: out of window).
    swa_pages: list[int] = field(default_factory=list)
    swa_live_from: int = 0
    traceparent: str = ""
    tracestate: str = ""
    # Structured generation: the request's place in its grammar (rank 0 only;
    # built at its first sampling step, from the tokens it has by then).
    grammar: GrammarState | None = None
    # The LoRA adapter of the slot the request joined through (None: the base
    # model); held for the request's life, whatever happens to the slot or name.
    adapter: LoadedAdapter | None = None
    # An embedding request: "last" or "mean" ("": generation), and what the
    # model step keeps for it between prompt chunks (mean pooling: the sum of
    # the hidden states so far).
    pooling: str = ""
    normalize: bool = False
    pooled: Any = None

    @classmethod
    def from_join(cls, join: Join, adapter: LoadedAdapter | None = None) -> SlotState:
        tokens = list(join.prefix_ids)
        kv_len = len(tokens)
        if join.last_token is not None:  # landed: the prompt's KV is in kv_pages
            tokens.append(join.last_token)
        return cls(
            rid=join.rid,
            sampling=join.sampling,
            logprobs=join.logprobs,
            prompt_len=join.prompt_len,
            tokens=tokens,
            kv_len=kv_len,
            pages=list(join.kv_pages),
            traceparent=join.traceparent,
            tracestate=join.tracestate,
            adapter=adapter,
            pooling=join.pooling,
            normalize=join.normalize,
        )

    @property
    def has_sampled_token(self) -> bool:
        """The last token was sampled and still has to be computed (decode)."""
        return len(self.tokens) == self.kv_len + 1

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        lp = self.logprobs
        return lp.return_logprob and 0 <= lp.logprob_start_len < self.prompt_len
