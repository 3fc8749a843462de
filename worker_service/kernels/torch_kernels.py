"""Plain torch kernels: the CPU path and the reference for the FlashInfer ones.

The model's ops repeat the Hugging Face arithmetic step for step (float32
upcast in RMSNorm and RoPE, the cast back before RMSNorm's weight), so a CPU
model matches transformers to the last bit. Nothing here works in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.kernels.base import SamplingFilters


class TorchKernels:
    name = "torch"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rmsnorm(residual, weight, eps), residual

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        rot = cos_sin_cache.shape[-1]
        if rot == q.shape[-1]:
            return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        # Partial rotary: the first ``rot`` dims rotate, the rest pass (HF's order).
        return tuple(
            torch.cat((_rotate_half(x[..., :rot], cos, sin), x[..., rot:]), dim=-1) for x in (q, k)
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def gemma_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' Gemma RMSNorm: the weight's 1 + w and the product in
        # float32, one rounding at the end (Llama's rounds before its weight).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (1.0 + weight.float())).to(x.dtype)

    def gemma_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.gemma_rmsnorm(residual, weight, eps), residual

    def filter_probs(self, probs: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
        """Thresholds from one descending sort; each filter keeps the tokens at or
        above its threshold, so ties at a boundary stay together, as FlashInfer's
        threshold kernels keep them."""
        if not (filters.use_top_k or filters.use_top_p):
            return min_p_mask(probs, filters.min_p) if filters.use_min_p else probs
        sorted_p = probs.sort(dim=-1, descending=True).values
        threshold = sorted_p.gather(1, (filters.top_k - 1).unsqueeze(1))  # k-th largest
        if filters.use_top_p:
            cum = sorted_p.cumsum(dim=-1)
            n_k = (sorted_p >= threshold).sum(dim=1, keepdim=True)  # top-k and its ties
            mass_k = cum.gather(1, n_k - 1)
            # top_p >= 1 keeps everything: comparing against the float mass could
            # drop a tail token through rounding.
            top_p = filters.top_p.unsqueeze(1)
            target = torch.where(top_p >= 1.0, torch.inf, top_p * mass_k)
            # Rank r >= 1 stays while the mass before it is < target; rank 0 always.
            n_p = 1 + (cum[:, :-1] < target).sum(dim=1, keepdim=True)
            threshold = torch.maximum(threshold, sorted_p.gather(1, n_p - 1))
        kept = probs.masked_fill(probs < threshold, 0.0)
        return min_p_mask(kept, filters.min_p) if filters.use_min_p else kept


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens below ``min_p`` times the row's largest probability (a ratio, so
    the same before or after renormalising); min_p <= 1 keeps the largest."""
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < floor, 0.0)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` on the two halves, in float32:
    ``x1 * c - x2 * s`` equals ``x1 * c + (-x2) * s`` bit for bit."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
