"""Which experts each token goes to, and with what weights.

The rules are transformers' routers, op for op (so fp32 runs agree with them
to the last bit):

- ``softmax_topk`` (Qwen3-MoE, OLMoE, Mixtral): a float32 softmax over all
  experts' router logits, the k largest probabilities, divided by their sum
  when ``norm_topk_prob`` (Mixtral always renormalises: its reader sets it);
- ``topk_softmax`` (GPT-OSS): the k largest router logits (with the router's
  bias), then a softmax over those k.

Ties between equal probabilities go to the lower expert index, as
``torch.topk`` breaks them on CPU.
"""

from __future__ import annotations

import torch

from worker_service.models.config import MoeConfig

SOFTMAX_TOPK = "softmax_topk"
TOPK_SOFTMAX = "topk_softmax"
RULES = (SOFTMAX_TOPK, TOPK_SOFTMAX)


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, expert ids (T, k) int64) from router logits (T, E)."""
    if moe.router == SOFTMAX_TOPK:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if moe.router != TOPK_SOFTMAX:
        raise ValueError(f"unknown MoE routing rule {moe.router!r} (known: {', '.join(RULES)})")
    top, ids = torch.topk(logits, moe.top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype).float(), ids
