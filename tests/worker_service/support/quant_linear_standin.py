"""A torch stand-in for worker_service/kernels/quant_linear.py (the C kernel's
wrapper, docs/design.md): the same functions, each call dequantizing with
gguf's numpy codecs. It lets the integration tests run where the C library is
absent, and is the dequantize-then-matmul reference the layers are held to.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

KERNEL_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})


@dataclass(frozen=True)
class QuantWeight:
    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def block_size(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[_qtype(qtype)][0]


def row_bytes(qtype: str, in_features: int) -> int:
    size, nbytes = gguf.GGML_QUANT_SIZES[_qtype(qtype)]
    return in_features // size * nbytes


def pack(
    qtype: str, blocks: torch.Tensor | np.ndarray, out_features: int, in_features: int
) -> QuantWeight:
    data = torch.as_tensor(np.ascontiguousarray(blocks)).clone()
    assert data.shape == (out_features, row_bytes(qtype, in_features)), data.shape
    return QuantWeight(qtype, out_features, in_features, data)


def dequantize(w: QuantWeight) -> torch.Tensor:
    values = gguf.quants.dequantize(w.data.numpy(), _qtype(w.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    rows = w.data[ids.long()].numpy()
    values = gguf.quants.dequantize(rows, _qtype(w.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def matmul(
    x: torch.Tensor,
    w: QuantWeight,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    result = F.linear(x, dequantize(w), bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def available() -> bool:
    return True
