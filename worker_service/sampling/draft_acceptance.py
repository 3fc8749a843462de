"""Speculative decoding on the worker: which drafts a step's samples accept.

A drafted extend (``Extend.draft_len`` = k > 0) computes the request's last
sampled token and k drafted tokens d[0..k-1] after it, and its compute samples
at each of those k + 1 positions as if the drafts before it were accepted:
sample s_j follows d[0..j-1] (same penalties, min_new_tokens and seeded draw
as plain decoding at that output count). The accepted length a is the first j
with s_j != d_j (k if there is none), and the entry yields s_0 .. s_a: the a
accepted drafts (which equal their samples), then the sample after them. Each
token is exactly what plain decoding would have sampled there, so the output
is the same as without drafts, one step per token saved.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker_service.sampling.rows import SampleOutput


def accepted_drafts(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many leading drafts equal the samples at their positions."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


def accept_drafts(drafts: Sequence[Sequence[int]], out: SampleOutput) -> SampleOutput:
    """``out`` with one row per sampled position (len(d) + 1 per entry) cut to
    the accepted tokens: per-token lists and ``token_counts`` per entry.
    ``drafts``: each sampling entry's drafts, in order (empty: a plain entry)."""
    rows_needed = sum(len(d) + 1 for d in drafts)
    if len(out.token_ids) != rows_needed:
        raise ValueError(f"{len(out.token_ids)} sampled rows for {rows_needed} sampled positions")
    kept = SampleOutput(prompt_logprobs=out.prompt_logprobs)
    row = 0
    for d in drafts:
        count = accepted_drafts(d, out.token_ids[row : row + len(d)]) + 1 if d else 1
        rows = slice(row, row + count)
        kept.token_ids += out.token_ids[rows]
        kept.logprobs += out.logprobs[rows]
        kept.top_ids += out.top_ids[rows]
        kept.top_logprobs += out.top_logprobs[rows]
        kept.ids_logprobs += out.ids_logprobs[rows]
        kept.token_counts.append(count)
        row += len(d) + 1
    return kept
