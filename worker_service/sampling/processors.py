"""Per-request logit processing before sampling: bias, penalties, min-new-tokens masking.

Applied in this order, on a copy of the raw logits (the raw logits stay intact
because logprobs are reported from them, see logprobs.py):

1. logit bias: ``logit[t] += bias`` (OpenAI ``logit_bias``; a token listed
   twice gets both biases added).
2. repetition penalty ``r`` over the tokens seen in prompt + output (HF /
   vLLM definition): ``logit / r`` where ``logit > 0``, else ``logit * r``.
3. frequency and presence penalties over the OUTPUT tokens only (OpenAI):
   ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``.
4. while ``len(output_ids) < min_new_tokens``: the EOS ids and the request's
   stop_token_ids get ``-inf`` (whatever ``ignore_eos`` says: masking an id
   that would not stop the request is harmless).

Token ids outside ``[0, V)`` in a bias, stop list or EOS list are ignored:
such tokens cannot be sampled, so there is nothing to change.
Everything is batched: Python only builds small index lists per row; the
(rows, V) work is a handful of tensor ops over the rows that need it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker_service.device.transfer import to_device
from worker_service.sampling.rows import SampleRow


def min_new_mask_ids(row: SampleRow) -> tuple[int, ...]:
    """Ids to forbid this step because the request has not yet produced min_new_tokens."""
    if row.output_count >= row.sampling.min_new_tokens:
        return ()
    return tuple(row.eos_token_ids) + tuple(row.sampling.stop_token_ids)


def needs_processing(row: SampleRow) -> bool:
    """Whether ``process_logits`` would change this row's logits."""
    s = row.sampling
    return bool(s.logit_bias) or s.has_penalties or bool(min_new_mask_ids(row))


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(seqs), vocab) float32: how often each token occurs in each sequence.

    The flat (row, id) pairs are built on the CPU and sent in one copy; the
    counting is one accumulate-scatter on the device (ids outside [0, vocab)
    are dropped).
    """
    counts = torch.zeros((len(seqs), vocab), dtype=torch.float32, device=device)
    parts = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if not parts:
        return counts
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long)
    flat_ids = torch.cat(parts)
    flat_rows = torch.repeat_interleave(torch.arange(len(parts)), lengths)
    keep = (flat_ids >= 0) & (flat_ids < vocab)
    flat_ids, flat_rows = to_device([flat_ids[keep].numpy(), flat_rows[keep].numpy()], device)
    ones = torch.ones(flat_ids.shape, dtype=torch.float32, device=device)
    counts.index_put_((flat_rows, flat_ids), ones, accumulate=True)
    return counts


def _pairs(per_row: list[Sequence[int]], vocab: int) -> tuple[list[int], list[int]]:
    """Flatten per-row id lists into (row index, id) lists, dropping out-of-range ids."""
    rr: list[int] = []
    tt: list[int] = []
    for i, ids in enumerate(per_row):
        for t in ids:
            if 0 <= t < vocab:
                rr.append(i)
                tt.append(t)
    return rr, tt


def _apply_penalties(out: torch.Tensor, rows: Sequence[SampleRow], idx: list[int]) -> None:
    """Repetition, frequency and presence penalties on ``out[idx]``, in place."""
    dev, vocab = out.device, out.shape[1]
    (sel,) = to_device([np.array(idx, np.int64)], dev)
    sub = out.index_select(0, sel)
    specs = [rows[i].sampling for i in idx]
    counts = token_counts([rows[i].output_ids for i in idx], vocab, dev)

    rep_vals = [s.repetition_penalty for s in specs]
    if any(r != 1.0 for r in rep_vals):
        # "seen" is prompt + output; prompts are only scattered for rows that use it.
        pairs = zip(idx, rep_vals, strict=True)
        prompts = [rows[i].prompt_ids if r != 1.0 else () for i, r in pairs]
        seen = (counts > 0) | (token_counts(prompts, vocab, dev) > 0)
        (rep,) = to_device([np.array(rep_vals, np.float32).reshape(-1, 1)], dev)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)

    freq_vals = [s.frequency_penalty for s in specs]
    pres_vals = [s.presence_penalty for s in specs]
    # Decided on the Python lists so that no device sync is needed.
    if any(freq_vals) or any(pres_vals):
        freq, pres = to_device(
            [np.array(v, np.float32).reshape(-1, 1) for v in (freq_vals, pres_vals)], dev
        )
        sub = sub - freq * counts - pres * (counts > 0).float()
    out.index_copy_(0, sel, sub)


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Bias, penalties and min-new masking for every row (see the module docstring).

    logits: (B, V) float32, one row per entry of ``rows``. Never modified in
    place: returns a new tensor, or ``logits`` itself when no row needs any
    processing.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
    vocab, dev = logits.shape[1], logits.device
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    for i, row in enumerate(rows):
        for tok, val in row.sampling.logit_bias:
            if 0 <= tok < vocab:
                bias_rows.append(i)
                bias_ids.append(tok)
                bias_vals.append(val)
    pen_idx = [i for i, row in enumerate(rows) if row.sampling.has_penalties]
    mask_rows, mask_ids = _pairs([min_new_mask_ids(r) for r in rows], vocab)
    if not (bias_rows or pen_idx or mask_rows):
        return logits

    out = logits.clone()
    if bias_rows:
        b_rows, b_ids = to_device(
            [np.array(bias_rows, np.int64), np.array(bias_ids, np.int64)], dev
        )
        (vals,) = to_device([np.array(bias_vals, np.float64)], dev)
        out.index_put_((b_rows, b_ids), vals.to(out.dtype), accumulate=True)
    if pen_idx:
        _apply_penalties(out, rows, pen_idx)
    if mask_rows:
        where = to_device([np.array(mask_rows, np.int64), np.array(mask_ids, np.int64)], dev)
        out.index_put_(tuple(where), torch.full((), float("-inf"), dtype=out.dtype, device=dev))
    return out
