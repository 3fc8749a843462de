"""Prompt logprobs: which prompt positions a step scores, and their scores.

The logits at position p score the prompt token at p + 1, so a chunk scores
the positions it computes plus, when the scheduler gives it, the next prompt
token. The LM head runs PROMPT_LOGIT_ROWS rows at a time: a long prompt's
full float32 logits (rows x vocabulary) would not fit. The scores stay on the
device in a ``PromptScores`` until ``ModelCompute.finish`` reads them with the
step's tokens, after its one wait: converting them in ``launch`` would wait
for the device there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker_service.attention.base import SequenceSlice
from worker_service.device.transfer import to_device
from worker_service.execution.step_work import SeqWork
from worker_service.sampling.logprobs import logprob_tensors
from worker_service.sampling.rows import PromptLogprobs

# Prompt rows per LM-head call when scoring prompt logprobs: 1024 rows of a
# 128k vocabulary are 0.5 GB of float32 logits; a whole 8k-token chunk at once
# would be 4 GB.
PROMPT_LOGIT_ROWS = 1024


@dataclass(slots=True)
class PromptSpan:
    work: SeqWork
    start: int  # first prompt position reported
    end: int  # exclusive
    rows: list[int]  # hidden rows of positions max(start, 1) - 1 .. end - 2


@dataclass(slots=True)
class PromptScores:
    """A span's prompt logprobs, left on the device by ``launch``; ``finish``
    reads them with the step's tokens, after its one wait."""

    slot: int
    start: int  # first prompt position reported (0: its logprob is NaN)
    logprobs: torch.Tensor  # (rows, 1 + requested ids): the prompt token's, then theirs
    top_ids: torch.Tensor | None  # (rows, top_n); None: no top logprobs asked for
    top_logprobs: torch.Tensor | None
    ids_asked: bool

    def tensors(self) -> list[torch.Tensor]:
        top = [self.top_ids, self.top_logprobs] if self.top_ids is not None else []
        return [self.logprobs, *top]

    def on_host(self, host: list[torch.Tensor]) -> PromptLogprobs:
        """``host``: ``tensors()`` on the host, in order."""
        lp_rows = host[0].tolist()
        head = [math.nan] if self.start == 0 else []
        out = PromptLogprobs(self.slot, self.start, head + [row[0] for row in lp_rows])
        if self.top_ids is not None:
            out.top_ids = [i for row in host[1].tolist() for i in row]
            out.top_logprobs = [x for row in host[2].tolist() for x in row]
        if self.ids_asked:
            out.ids_logprobs = [x for row in lp_rows for x in row[1:]]
        return out


def prompt_spans(work: list[SeqWork], seqs: Sequence[SequenceSlice]) -> list[PromptSpan]:
    """Which prompt positions this step scores, and the hidden rows they need."""
    spans: list[PromptSpan] = []
    for w, s in zip(work, seqs, strict=True):
        state = w.state
        if not state.wants_prompt_logprobs or w.start >= state.prompt_len:
            continue
        end_known = w.start + len(w.inputs)  # positions < end_known are in this chunk
        if w.next_token is not None:
            end_known += 1  # and the next prompt token is given
        start = max(state.logprobs.logprob_start_len, w.start + 1 if w.start else 0)
        end = min(end_known, state.prompt_len)
        if end <= start:
            continue
        scored = range(max(start, 1), end)  # position 0 has no logprob
        rows = [s.q_start + (p - 1 - w.start) for p in scored]
        spans.append(PromptSpan(w, start, end, rows))
    return spans


def score_prompt(
    span: PromptSpan,
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
) -> PromptScores:
    """The span's logprobs, PROMPT_LOGIT_ROWS rows of ``lm_head`` at a time,
    left on the device (the module docstring)."""
    w, state = span.work, span.work.state
    lp = state.logprobs
    first = max(span.start, 1)
    # Column 0: the prompt token each row scores; then the requested ids.
    cols = np.empty((span.end - first, 1 + len(lp.token_ids_logprob)), dtype=np.int64)
    cols[:, 0] = [
        state.tokens[p] if p < w.start + len(w.inputs) else w.next_token
        for p in range(first, span.end)
    ]
    cols[:, 1:] = lp.token_ids_logprob
    rows = np.array(span.rows, dtype=np.int64)
    parts = []
    for at in range(0, len(rows), PROMPT_LOGIT_ROWS):
        index, ids = to_device(
            [rows[at : at + PROMPT_LOGIT_ROWS], cols[at : at + PROMPT_LOGIT_ROWS]],
            hidden.device,
        )
        logits = lm_head(hidden.index_select(0, index))
        parts.append(logprob_tensors(logits, ids, top_n=lp.top_logprobs_num))
    top_n = max(lp.top_logprobs_num, 0)
    if not parts:  # position 0 alone: no row
        empty = torch.empty((0, cols.shape[1]), dtype=torch.float32)
        logprobs, top_ids, top_lps = empty, torch.empty((0, top_n)), torch.empty((0, top_n))
    else:
        logprobs = _cat([p.logprobs for p in parts])
        top_ids = _cat([p.top_ids for p in parts])
        top_lps = _cat([p.top_logprobs for p in parts])
    asked_top = bool(lp.top_logprobs_num)
    return PromptScores(
        w.slot,
        span.start,
        logprobs,
        top_ids if asked_top else None,
        top_lps if asked_top else None,
        ids_asked=bool(lp.token_ids_logprob),
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
