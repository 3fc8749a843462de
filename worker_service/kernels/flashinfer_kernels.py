"""FlashInfer's fused kernels for the ops of ``Kernels`` (CUDA, fp16/bf16 only).

Which kernel replaces which torch ops (launches of the bf16 torch path in
parentheses; the review counted 30-40 per decoder layer):

- ``flashinfer.norm.rmsnorm``: RMSNorm (upcast, square, mean, + eps, rsqrt,
  mul, cast, weight: 8 -> 1); also the (T, H, D) qk-norm of Qwen3.
- ``flashinfer.norm.fused_add_rmsnorm``: the residual add and the next RMSNorm
  in one kernel, in place: ``residual += x`` then ``x = rmsnorm(residual)``
  (9 -> 1, twice per layer). It takes the norm of the float32 sum before
  rounding it into ``residual`` and multiplies the weight in float32, so it
  differs from HF in the last bf16 bit now and then (HF rounds twice).
- ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``: RoPE (a gather,
  then for q and k: upcast, 4 muls, sub, add, cat, cast: 19 -> 1), in place;
  ``is_neox=True`` is HF's rotate-half layout. It reads a float32 cache of shape (positions, D): the
  D/2 cosines then the D/2 sines of each position, used as given, so every
  scaling (linear, llama3, per-frequency GGUF factors: in the frequencies;
  yarn's attention factor: multiplied into cos and sin) comes for free.
- ``flashinfer.activation.silu_and_mul``: ``silu(gate) * up`` (2 -> 1);
  ``gelu_tanh_and_mul`` the same for Gemma's GeGLU.
- ``flashinfer.norm.gemma_rmsnorm`` / ``gemma_fused_add_rmsnorm``: Gemma's
  RMSNorm (``x / RMS(x) * (1 + w)``, the weight and product in float32), plain
  and with the residual add, as the two above; the plain one takes 2-D input
  only, so Gemma 3's (T, H, D) query/key norm runs on T * H rows.
- ``flashinfer.sampling.top_k_renorm_probs`` / ``top_p_renorm_probs``: the
  top-k and top-p filters by radix threshold search, no vocabulary sort. Both
  keep every token at or above the threshold (ties together) and renormalise.
  ``is_deterministic=True`` makes their sums integer-exact, hence the same
  whatever the batch around a row. min-p is three elementwise torch ops.

The draw itself stays ours (sampling/filters.py): FlashInfer's sampling
kernels draw from their own Philox stream, which would break the seeded
requests' guarantee (same seed, same tokens, whatever the batch or device).

RoPE's cos/sin-cache kernel has a dedicated path for head dims 64, 128, 256
and 512 (the Llama family's); other head dims run the torch RoPE here rather
than FlashInfer's general RoPE+quantize route, which we have not checked.

Nothing here syncs with the host or allocates outside torch's caching
allocator, so a decode forward with these kernels can be captured in a CUDA
graph. FlashInfer is imported when the object is built, not with the module.
"""

from __future__ import annotations

import torch

from worker_service.kernels.base import SamplingFilters
from worker_service.kernels.torch_kernels import TorchKernels, min_p_mask

FAST_ROPE_HEAD_DIMS = (64, 128, 256, 512)


class FlashInferKernels:
    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
        import flashinfer.sampling

        # Modules, not functions: each call looks the function up, so tests can
        # swap FlashInfer's functions for reference implementations.
        self._norm = flashinfer.norm
        self._rope = flashinfer.rope
        self._activation = flashinfer.activation
        self._sampling = flashinfer.sampling
        self._torch = TorchKernels()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rmsnorm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: residual becomes residual + x, then x its norm.
        self._norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = q.shape[-1]
        if head_dim not in FAST_ROPE_HEAD_DIMS:
            return self._torch.rope(positions, q, k, cos_sin_cache)
        # q and k may be strided views of the fused qkv output: the kernel takes
        # row and head strides (only the last dim must be contiguous).
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, head_dim, cos_sin_cache, is_neox=True
        )
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._activation.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._activation.gelu_tanh_and_mul(gate_up)

    def gemma_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2:
            return self._norm.gemma_rmsnorm(x, weight, eps)
        # Its kernel takes (rows, dim) only (rmsnorm's also takes heads): the
        # query/key norm's (T, H, D) as T * H rows (a copy where q and k are
        # strided views of the fused projection).
        return self._norm.gemma_rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def gemma_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._norm.gemma_fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def filter_probs(self, probs: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
        # top-p after top-k: it then applies to the top-k distribution, as ours does.
        if filters.use_top_k:
            probs = self._sampling.top_k_renorm_probs(probs, filters.top_k, is_deterministic=True)
        if filters.use_top_p:
            probs = self._sampling.top_p_renorm_probs(probs, filters.top_p, is_deterministic=True)
        return min_p_mask(probs, filters.min_p) if filters.use_min_p else probs
