"""Log-probabilities of tokens, read from the model's raw logits.

Every logprob the worker reports (the chosen token's, the top-n, the requested
ids', and prompt logprobs) is ``log_softmax`` of the RAW logits: before logit
bias, penalties, min-new-tokens masking, temperature and top-k/p/min-p
filtering. That is vLLM's default ("raw logprobs"): the numbers describe the
model, not the sampling settings, so they compare directly with a Hugging Face
reference run whatever the request's sampling parameters.

``log_softmax(x)[i] == x[i] - logsumexp(x)``, so only one logsumexp per row is
needed and the full (N, V) log-softmax is never materialised. On the CPU, for
float32 logits, that is one C call (kernels/c_sources/cpu_ops.c's
token_logprobs: a row's maximum, its sum of exponentials, then the gathers,
within a few ulp of torch's; no temporaries); elsewhere torch's ops, chunk by
chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker_service.kernels.cpu_kernels import CpuKernels

# Rows per chunk: logsumexp allocates a temporary as large as its input, and
# prompt logprobs can cover thousands of positions of a 150k-token vocabulary.
DEFAULT_CHUNK_ROWS = 1024


@functools.cache
def cpu_ops() -> CpuKernels | None:
    """The C small ops (their token_logprobs here, temperature_draw for the
    sampler), built once; None where they cannot be (no compiler)."""
    from worker_service.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


def prepare(device: torch.device) -> None:
    """Build (or load) the CPU's C logprobs and draw now, at start, so that no
    step waits for the compiler (the sampler calls this)."""
    if device.type == "cpu":
        cpu_ops()


@dataclass
class LogprobTensors:
    """Logprobs of given ids (and optionally the top-n tokens) for N rows of logits.

    logprobs: float32, the shape of ``ids`` ((N,) or (N, K)):
        ``log_softmax(logits[n])[ids[n, k]]``; NaN where the id lies outside
        ``[0, V)``, so ragged per-row id lists can be padded with -1.
    top_ids: int64 (N, top_n), the most probable ids, most probable first
        (the order among exactly tied logits is whatever ``torch.topk`` gives).
    top_logprobs: float32 (N, top_n), their logprobs.
    """

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def logprob_tensors(
    logits: torch.Tensor,
    ids: torch.Tensor,
    top_n: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> LogprobTensors:
    """Logprobs of ``ids`` under ``log_softmax(logits)``, row by row, plus the top ``top_n``.

    logits: (N, V) raw model logits (any float dtype; computed in float32).
    ids: (N,) or (N, K) int token ids; -1 (or any id outside [0, V)) pads and yields NaN.
    Stays on the logits' device (no host sync): the sampler's building block.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got {tuple(logits.shape)}")
    n, vocab = logits.shape
    squeeze = ids.dim() == 1
    ids2 = ids.view(n, 1) if squeeze else ids
    if ids2.dim() != 2 or ids2.shape[0] != n:
        raise ValueError(f"ids {tuple(ids.shape)} do not match logits {tuple(logits.shape)}")
    top_n = min(max(top_n, 0), vocab)
    if logits.device.type == "cpu" and n and (ops := cpu_ops()) is not None:
        done = ops.token_logprobs(logits, ids2)
        if done is not None:
            out, lse = done
            top_ids = torch.empty((n, 0), dtype=torch.long)
            top_lp = torch.empty((n, 0), dtype=torch.float32)
            if top_n:
                vals, top_ids = logits.topk(top_n, dim=-1, largest=True, sorted=True)
                top_lp = vals - lse
            return LogprobTensors(
                logprobs=out.view(n) if squeeze else out, top_ids=top_ids, top_logprobs=top_lp
            )
    dev = logits.device
    ids2 = ids2.to(device=dev, dtype=torch.long)
    valid = (ids2 >= 0) & (ids2 < vocab)
    safe_ids = torch.where(valid, ids2, torch.zeros_like(ids2))

    out = torch.empty(ids2.shape, dtype=torch.float32, device=dev)
    top_ids = torch.empty((n, top_n), dtype=torch.long, device=dev)
    top_lp = torch.empty((n, top_n), dtype=torch.float32, device=dev)
    for start in range(0, n, max(chunk_rows, 1)):
        end = min(start + chunk_rows, n)
        chunk = logits[start:end].float()
        lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
        out[start:end] = chunk.gather(1, safe_ids[start:end]) - lse
        if top_n:
            vals, idx = chunk.topk(top_n, dim=-1, largest=True, sorted=True)
            top_ids[start:end] = idx
            top_lp[start:end] = vals - lse
    out = out.masked_fill(~valid, float("nan"))
    return LogprobTensors(
        logprobs=out.view(n) if squeeze else out, top_ids=top_ids, top_logprobs=top_lp
    )


@dataclass
class TokenLogprobs:
    """Host-side logprobs for N rows, ready for the result message.

    logprobs[n]: logprob of ``ids[n]``; top_ids[n] / top_logprobs[n]: the
    ``top_n`` most probable tokens; ids_logprobs[n]: the logprobs of
    ``token_ids`` (the same ids for every row; NaN for an id outside [0, V)).
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ids_logprobs: list[list[float]]


def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    top_n: int = 0,
    token_ids: Sequence[int] = (),
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> TokenLogprobs:
    """Logprobs of ``ids`` (N,) under ``log_softmax(logits)`` (N, V), plus top-n and fixed ids.

    Built for prompt logprobs: the logprob of prompt token t is read from the
    logits at position t - 1, so for positions [start, T) pass
    ``logits[start-1 : T-1]`` with ``ids = prompt[start:T]`` (position 0 has
    no logprob; callers report NaN for it).
    """
    n = logits.shape[0]
    if ids.shape != (n,):
        raise ValueError(f"ids {tuple(ids.shape)} must be ({n},) for logits {tuple(logits.shape)}")
    # One gather for the target and the requested ids: column 0, then the rest.
    cols = torch.empty((n, 1 + len(token_ids)), dtype=torch.long, device=logits.device)
    cols[:, 0] = ids.to(device=logits.device, dtype=torch.long)
    if token_ids:
        cols[:, 1:] = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    res = logprob_tensors(logits, cols, top_n, chunk_rows)
    lp = res.logprobs.tolist()
    return TokenLogprobs(
        logprobs=[r[0] for r in lp],
        top_ids=res.top_ids.tolist(),
        top_logprobs=res.top_logprobs.tolist(),
        ids_logprobs=[r[1:] for r in lp],
    )
