"""Linear layers on the CPU through oneDNN with weights packed once.

torch's ``F.linear`` on the CPU hands each call's weight to MKL in its
plain (out, in) layout; oneDNN's linear with the weight reordered once into
its own blocked layout runs the skinny matmuls of a decode step (a few to a
few dozen rows against every weight of the model) about 1.3x (1 row) to
1.7x (16 rows) faster, and the 49k-row LM head about 2x, measured on the
default model's shapes on one core (docs/benchmarks.md). The packed copy is
made after the weights are loaded; the plain weight stays (the embedding,
LoRA's shape checks and tensor-parallel loading read it).
"""

from __future__ import annotations

import torch

# The batch size oneDNN picks the packed layout for: decode batches.
PACK_FOR_ROWS = 16


def available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or None where it does not apply."""
    if not available(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) with a packed weight; x is (rows, in)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
