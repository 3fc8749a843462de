"""Embedding requests: their final-norm hidden states pooled where the LM head
would run (the last prompt position's, or the mean over the prompt, summed
chunk by chunk in float32), or a sequence classifier's score head on the
last one. The vector stays on the device until ``ModelCompute.finish``.
"""

from __future__ import annotations

import torch

from worker_service.execution.step_work import SeqWork
from worker_service.models.layers import ScoreHead


def pool_embedding(
    w: SeqWork, rows: torch.Tensor, score: ScoreHead | None
) -> tuple[int, torch.Tensor] | None:
    """An embedding request's chunk (``rows``: its final-norm hidden states):
    the vector once the chunk ends the prompt, else None (a mean's running
    sum kept in float32 on the device, as the chunk sizes vary). A
    classifier's vector is its ``score`` head's logits at the last token
    (SGLang's ``score_and_pool``; the worker refuses any other pooling)."""
    state = w.state
    end = w.start + len(w.inputs)
    if state.pooling == "mean":
        part = rows.float().sum(dim=0)
        state.pooled = part if state.pooled is None else state.pooled + part
    if end != state.prompt_len:
        return None
    if state.pooling == "mean":
        vec = state.pooled / state.prompt_len
        state.pooled = None
    elif score is not None:
        vec = score(rows[-1])
    else:
        vec = rows[-1].float()
    if state.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return w.slot, vec
