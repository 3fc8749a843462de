"""Linear layers on the CPU with weights packed once, two ways.

- Steps of few rows (decode batches, verify rows, short extends: up to
  ``SKINNY_MAX_ROWS``) go through our C kernel (kernels/c_sources/
  skinny_linear.c): 0.66x of oneDNN's time at 1 row, 0.69x at 8, 0.88x at 16
  and 32 on the default model's projections, and its threads take work
  dynamically, so a core lost to another process for a while slows the step
  instead of stalling it (docs/benchmarks.md).
- Longer steps (prefill) go through oneDNN's linear with the weight reordered
  into its blocked layout: about 1.3x (1 row) to 2x (the LM head) faster
  than torch's ``F.linear``, and ahead of the C kernel past a few hundred rows.

Both copies are made after the weights are loaded (float32; bf16 weights get
the oneDNN copy only); the plain weight stays (the embedding, LoRA's shape
checks and tensor-parallel loading read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.kernels.cpu_kernels import SkinnyLinear, load_skinny_linear

# The batch size oneDNN picks the packed layout for: decode batches.
PACK_FOR_ROWS = 16
# Steps of at most this many rows take the C kernel.
SKINNY_MAX_ROWS = 128


@dataclass(frozen=True)
class PackedWeight:
    onednn: torch.Tensor
    skinny: torch.Tensor | None  # None: no C kernel here (or not float32)
    kernel: SkinnyLinear | None  # with torch's thread count when packed
    out_features: int


def available(weight: torch.Tensor) -> bool:
    """Whether oneDNN packs this weight here. bf16 needs CPU support
    (avx512bw/vl/dq or avx_ne_convert): oneDNN's reorder raises without it,
    and such weights stay plain (F.linear)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The weight's packed copies, or None where packing does not apply."""
    if not available(weight):
        return None
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)
    skinny = None
    kernel = load_skinny_linear(torch.get_num_threads())
    if kernel is not None and weight.dtype == torch.float32:
        skinny = kernel.pack(weight)
    return PackedWeight(onednn, skinny, kernel, weight.shape[0])


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) with a packed weight; x is (rows, in)."""
    kernel = packed.kernel
    if (
        kernel is not None
        and packed.skinny is not None
        and x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype == torch.float32
    ):
        return kernel(x, packed.skinny, packed.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.onednn, bias, "none", [], "")
