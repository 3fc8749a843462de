"""The interface both kernel sets implement, and the sampling filters' parameters.

A ``Kernels`` object holds the small per-token ops of a decoder layer (RMSNorm,
residual add + RMSNorm, RoPE, SiLU-and-mul; Gemma's RMSNorm and GeGLU) and
the sampler's top-k / top-p / min-p filter. Shapes: ``T`` tokens, ``H``
heads, ``D`` head dim, ``S`` sampled rows, ``V`` vocabulary.

Ops may work in place: ``add_rmsnorm`` and ``rope`` are allowed to overwrite
their tensor arguments (FlashInfer's kernels do; the torch ones do not), so
callers pass only tensors nothing else reads afterwards and use the returned
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingFilters:
    """Per-row filter parameters of the drawn rows, on the probabilities' device.

    ``top_k`` (S,) int64 in [1, V], V meaning no limit; ``top_p`` (S,) float32 in
    [0, 1], 1 keeping everything; ``min_p`` (S,) float32 in [0, 1]. The ``use_*``
    flags, known on the host, say whether any row uses that filter: the others
    run no kernel at all, and nobody waits on the device to find out.
    """

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @property
    def any(self) -> bool:
        return self.use_top_k or self.use_top_p or self.use_min_p


class Kernels(Protocol):
    name: str

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / RMS(x) * weight`` over the last dim; x (T, hidden) or (T, H, D)."""
        ...

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + x), residual + x)`` for (T, hidden) ``x`` and
        ``residual``; may overwrite both."""
        ...

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D) and k (T, H_kv, D) rotated (rotate-half convention) at
        ``positions`` (T,) int64; ``cos_sin_cache`` (max positions, R) float32 holds
        cos then sin of each of the R/2 frequencies, any scale folded in: the
        first R dims of each head rotate (R = D but for partial rotary RoPE),
        the rest pass. May rotate q and k in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` (T, 2F) = [gate | up]; (T, F)."""
        ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU, Gemma's
        gelu_pytorch_tanh) for ``gate_up`` (T, 2F) = [gate | up]; (T, F)."""
        ...

    def gemma_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``x / RMS(x) * (1 + weight)`` in float32, rounded
        once to x's dtype; x (T, hidden) or (T, H, D)."""
        ...

    def gemma_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gemma_rmsnorm(residual + x), residual + x)``; may overwrite both."""
        ...

    def filter_probs(self, probs: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
        """(S, V) float32: ``probs`` with every token the filters drop set to 0 and
        the kept ones in proportion (whether renormalised is the kernel's business:
        the draw divides by the kept mass); see sampling/filters.py."""
        ...
