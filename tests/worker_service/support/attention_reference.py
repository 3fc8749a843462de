"""A plain attention reference for the attention features: per sequence and
query, an explicit softmax over the real positions it may see (causal, inside
the window: key k is visible to the query at position q iff q - window < k <= q),
with the scale, the soft cap (cap * tanh(scores / cap)) and the sinks (exp(sink)
in the denominator, no value). Keys and values are read back from the cache
through the batch's page table; nothing is shared with the backends' code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.worker_service.support.attention_batches import pages_of
from worker_service.attention.base import AttentionBatch
from worker_service.device.kv_cache import KvCache


@dataclass(frozen=True)
class Features:
    """One case of the features: None leaves one off."""

    soft_cap: float | None = None
    scale: float | None = None  # None: head_dim ** -0.5
    sinks: bool = False
    window: int | None = None

    @property
    def name(self) -> str:
        parts = [
            f"cap{self.soft_cap}" if self.soft_cap else "",
            f"scale{self.scale}" if self.scale else "",
            "sinks" if self.sinks else "",
            f"window{self.window}" if self.window else "",
        ]
        return "-".join(p for p in parts if p) or "plain"


def random_sinks(heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits on the scale of real scores: large enough to move every output."""
    return torch.randn(heads, generator=gen) * 2.0


def reference_attention(
    batch: AttentionBatch,
    q: torch.Tensor,
    kv: KvCache,
    layer: int,
    *,
    features: Features,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """(T, heads, D) float64 outputs of every query of ``batch``."""
    heads, head_dim = q.shape[1], q.shape[2]
    cache = kv.layers[layer].double()
    kv_heads = cache.shape[-2]
    group = heads // kv_heads
    scale = features.scale if features.scale is not None else head_dim**-0.5
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in batch.seqs:
        pages = pages_of(batch, s)
        keys = cache[pages, 0].reshape(-1, kv_heads, head_dim)[: s.kv_len]
        values = cache[pages, 1].reshape(-1, kv_heads, head_dim)[: s.kv_len]
        keys = keys.repeat_interleave(group, dim=1)  # (kv_len, heads, D)
        values = values.repeat_interleave(group, dim=1)
        qs = q[s.q_start : s.q_start + s.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        if features.soft_cap is not None:
            scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
        pos = torch.arange(s.kv_len - s.q_len, s.kv_len)[:, None]
        key = torch.arange(s.kv_len)[None, :]
        visible = key <= pos
        if features.window is not None:
            visible &= key > pos - features.window
        top = scores.masked_fill(~visible, -torch.inf).amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - top) * visible
        denominator = weights.sum(dim=-1, keepdim=True)
        if sinks is not None:
            # exp(sink) on the same shifted scale as the scores
            denominator = denominator + torch.exp(sinks.double()[:, None, None] - top)
        out[s.q_start : s.q_start + s.q_len] = torch.einsum(
            "hqk,khd->qhd", weights / denominator, values
        )
    return out
