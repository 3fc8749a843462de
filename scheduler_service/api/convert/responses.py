"""Core outputs -> GenerateResponse messages, as SGLang's servicer shapes them.

Streaming: a chunk per batch of new tokens (token deltas, cumulative counts,
incremental output logprobs, the prompt's logprobs in the first chunk), and
at the end the last chunk followed by a GenerateComplete that repeats it.
Not streaming: one GenerateComplete per sample with every token and the
cumulative logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.core.plan import TokenLogprobs


@dataclass
class SampleState:
    """What the API process accumulates for one sample of a Generate call."""

    rid: str
    index: int
    prompt_ids: list[int]
    logprob_start: int  # -1: no prompt logprobs
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    cached_tokens: int = 0
    finish: ipc.Finish | None = None
    # streamed and not sent yet (stream_interval > 1, or a possible stop string)
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # prefill-only scoring's next-token row, and whether a chunk carried it
    next_token_row: TokenLogprobs | None = None
    next_token_row_sent: bool = False
    # The output ends with the start of a stop string (the core's news): wait.
    holding: bool = False
    # The output length at which the next streamed chunk is due.
    next_chunk_at: int = 1
    # require_reasoning: the end-of-reasoning token; reasoning_tokens counts
    # the output up to and including its first occurrence (SGLang's count).
    reasoning_end: int | None = None
    reasoning_tokens: int = 0
    reasoning_over: bool = False

    def _count_reasoning(self, tokens: list[int]) -> None:
        if self.reasoning_end is None or self.reasoning_over:
            return
        try:
            self.reasoning_tokens += tokens.index(self.reasoning_end) + 1
            self.reasoning_over = True
        except ValueError:
            self.reasoning_tokens += len(tokens)

    def has_prompt_logprobs(self) -> bool:
        """Every prompt position asked for has its logprob (position 0 has
        none: nothing precedes it)."""
        if self.logprob_start < 0:
            return True
        have = self.prompt_logprobs
        return all(p in have for p in range(max(self.logprob_start, 1), len(self.prompt_ids)))

    def take_unsent(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        tokens, lps = self.unsent_tokens, self.unsent_logprobs
        self.unsent_tokens, self.unsent_logprobs = [], []
        return tokens, lps

    def chunk_due(self, interval: int) -> bool:
        """Whether a streamed chunk goes out now (SGLang's rule): at the
        first token, then once every ``interval`` tokens (outputs 1, 1 + N,
        1 + 2N, ...), never while the text may be becoming a stop string
        (sent as soon as it cannot), always at the finish."""
        if self.finish is not None:
            return True
        n = len(self.output_ids)
        if self.holding or n < self.next_chunk_at:
            return False
        # the next point of the 1 + kN grid past n, so a held chunk keeps the rhythm
        self.next_chunk_at = 1 + interval * ((n - 1) // interval + 1)
        return True

    def add_news(self, tokens: list[int], cached: int) -> None:
        """Take in token news (api/inbox.py): ``add`` of deltas with a token
        each and nothing else, without building them."""
        self.output_ids += tokens
        if self.reasoning_end is not None and not self.reasoning_over:
            self._count_reasoning(tokens)
        self.cached_tokens = cached
        self.holding = False

    def add(self, d: ipc.DeltaOut) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Take a delta in; return its tokens and their logprobs."""
        self.output_ids.extend(d.token_ids)
        self._count_reasoning(d.token_ids)
        lps = d.logprobs or []
        self.logprobs.extend(lps)
        if d.prompt_logprobs:
            for i, lp in enumerate(d.prompt_logprobs):
                self.prompt_logprobs[d.prompt_logprobs_start + i] = lp
        self.cached_tokens = d.cached_tokens
        if d.next_token_logprobs is not None:
            self.next_token_row = d.next_token_logprobs
        if d.token_ids:  # a tokenless delta (prompt logprobs) says nothing of the text
            self.holding = d.holding
        if d.finish is not None:
            self.finish = d.finish
        return d.token_ids, lps


def output_logprobs(tokens: list[int], lps: list[TokenLogprobs | None]) -> pb.OutputLogProbs:
    m = pb.OutputLogProbs()
    for token, lp in zip(tokens, lps, strict=False):
        if lp is None:
            continue
        m.token_logprobs.append(lp.logprob if lp.logprob is not None else float("nan"))
        m.token_ids.append(token)
        if lp.top_ids is not None:
            m.top_logprobs.add(values=lp.top_logprobs, token_ids=lp.top_ids)
        if lp.ids is not None:
            m.token_ids_logprobs.add(values=lp.ids_logprobs, token_ids=lp.ids)
    return m


def _add_next_token_row(m: pb.OutputLogProbs, lp: TokenLogprobs) -> None:
    """Prefill-only scoring's one row: no token, so token_ids_logprobs alone."""
    if lp.ids is not None:
        m.token_ids_logprobs.add(values=lp.ids_logprobs, token_ids=lp.ids)


def input_logprobs(s: SampleState) -> pb.InputLogProbs:
    m = pb.InputLogProbs()
    for pos in range(s.logprob_start, len(s.prompt_ids)):
        lp = s.prompt_logprobs.get(pos)
        entry = m.token_logprobs.add()
        if lp is not None and lp.logprob is not None:
            entry.value = lp.logprob
        m.token_ids.append(s.prompt_ids[pos])
        if lp is not None and lp.top_ids is not None:
            m.top_logprobs.add(values=lp.top_logprobs, token_ids=lp.top_ids)
    return m


def wants_input_logprobs(s: SampleState) -> bool:
    return s.logprob_start >= 0 and not s.prompt_logprobs_sent


def accepted_chunk(rid: str, prompt_tokens: int) -> pb.GenerateResponse:
    """A chunk without tokens: the call is taken (a prefill unit's first
    answer to a disaggregated call, before its prompt's turn comes)."""
    r = pb.GenerateResponse(request_id=rid)
    r.chunk.SetInParent()
    r.chunk.prompt_tokens = prompt_tokens
    return r


def chunk(
    s: SampleState, rid: str, tokens: list[int], lps: list, *, with_logprobs: bool
) -> pb.GenerateResponse:
    # Filled in place: building the chunk apart and passing it to the
    # response's constructor copies it (twice the cost, once per token streamed).
    r = pb.GenerateResponse(request_id=rid)
    c = r.chunk
    c.SetInParent()
    c.token_ids.extend(tokens)
    c.prompt_tokens = len(s.prompt_ids)
    c.completion_tokens = len(s.output_ids)
    c.cached_tokens = s.cached_tokens
    c.reasoning_tokens = s.reasoning_tokens
    c.index = s.index
    if with_logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(tokens, lps))
        if s.next_token_row is not None and not s.next_token_row_sent:
            _add_next_token_row(c.output_logprobs, s.next_token_row)
            s.next_token_row_sent = True
    if wants_input_logprobs(s) and tokens:
        c.input_logprobs.CopyFrom(input_logprobs(s))
        s.prompt_logprobs_sent = True
    return r


def complete(
    s: SampleState, rid: str, tokens: list[int], lps: list, *, with_logprobs: bool
) -> pb.GenerateResponse:
    f = s.finish or ipc.Finish("abort")
    c = pb.GenerateComplete(
        output_ids=tokens,
        finish_reason=f.kind,
        prompt_tokens=len(s.prompt_ids),
        completion_tokens=len(s.output_ids),
        cached_tokens=s.cached_tokens,
        reasoning_tokens=s.reasoning_tokens,
        index=s.index,
        spec_draft_tokens=f.spec_draft_tokens,
        spec_accepted_tokens=f.spec_accepted_tokens,
    )
    if f.matched_token is not None:
        c.matched_token_id = f.matched_token
    elif f.matched_str is not None:
        c.matched_stop_str = f.matched_str
    if with_logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(tokens, lps))
        if s.next_token_row is not None:  # the complete carries every row
            _add_next_token_row(c.output_logprobs, s.next_token_row)
    if wants_input_logprobs(s):
        c.input_logprobs.CopyFrom(input_logprobs(s))
        s.prompt_logprobs_sent = True
    return pb.GenerateResponse(request_id=rid, complete=c)
