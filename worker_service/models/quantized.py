"""Weights the layers keep in a checkpoint's quantized format instead of float.

Two protocols, one per stage:

- ``QuantizedTensor``: a checkpoint matrix (out, in) still in its format, as
  a reader yields it in place of a float tensor. It can be cut into rows
  (column-parallel shards, a fused checkpoint tensor's parts) and columns
  (row-parallel shards), and becomes a ``QuantizedMatrix`` once a layer
  has all its parts. GGUF blocks (weights/gguf_quant.py) and FP8 weights
  with their scales implement it, so the layers have one path for both.
- ``QuantizedMatrix``: what a linear multiplies by. A layer holding one keeps
  no float copy of the matrix (its float parameter becomes a zero-stride
  placeholder that keeps the shape, read by LoRA's shape checks).

``fuse_rows`` builds one layer's matrix from its parts in output order:
consecutive parts of one format are concatenated into one matrix, and parts
of different formats (or float parts, e.g. an F16 v_proj beside Q4_K q/k)
each multiply the input into their own slice of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class QuantizedMatrix(Protocol):
    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(n, in) -> (n, out), in x's dtype."""
        ...

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32."""
        ...

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class QuantizedTensor(Protocol):
    name: str  # the checkpoint's name, for messages
    fmt: str  # parts of equal ``fmt`` can be concatenated by rows (``concat_rows``)

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), Hugging Face's layout."""
        ...

    def rows(self, lo: int, hi: int) -> QuantizedTensor: ...

    def columns(self, lo: int, hi: int) -> QuantizedTensor:
        """Raises UnsupportedModelError where the cut falls inside a block."""
        ...

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[QuantizedTensor]:
        """Rows cut into consecutive pieces, as ``torch.Tensor.split`` (dim 0 only)."""
        ...

    def concat_rows(self, others: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """This tensor's rows followed by ``others``' (all of this ``fmt``)."""
        ...

    def matrix(self) -> QuantizedMatrix: ...

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32."""
        ...


@runtime_checkable
class QuantizedTable(QuantizedMatrix, Protocol):
    """A quantized matrix that also reads whole rows (an embedding table)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), in) float32."""
        ...


def is_quantized(tensor: object) -> bool:
    return not isinstance(tensor, torch.Tensor) and isinstance(tensor, QuantizedTensor)


class DenseMatrix:
    """A float part of a layer whose other parts are quantized."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()
        self.out_features, self.in_features = self.weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class StackedMatrix:
    """Parts stacked by output rows, each multiplying into its own slice."""

    def __init__(self, parts: Sequence[QuantizedMatrix]) -> None:
        self.parts = list(parts)
        widths = {p.in_features for p in self.parts}
        if len(widths) != 1:
            raise ValueError(f"fused parts take different input widths {sorted(widths)}")
        self.in_features = widths.pop()
        self.out_features = sum(p.out_features for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], self.out_features))
        start = 0
        for part in self.parts:
            out[:, start : start + part.out_features] = part.matmul(x)
            start += part.out_features
        return out

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def fuse_rows(parts: Sequence[QuantizedTensor | torch.Tensor]) -> QuantizedMatrix:
    """One matrix for a layer's parts in output order (module docstring)."""
    groups: list[list[QuantizedTensor | torch.Tensor]] = []
    for part in parts:
        key = part.fmt if is_quantized(part) else None
        last = groups[-1][0] if groups else None
        same = last is not None and (last.fmt if is_quantized(last) else None) == key
        if same:
            groups[-1].append(part)
        else:
            groups.append([part])
    matrices: list[QuantizedMatrix] = []
    for group in groups:
        first = group[0]
        if is_quantized(first):
            assert isinstance(first, QuantizedTensor)
            whole = first.concat_rows(group[1:]) if len(group) > 1 else first  # type: ignore[arg-type]
            matrices.append(whole.matrix())
        else:
            matrices.append(DenseMatrix(torch.cat(group)))  # type: ignore[arg-type]
    return matrices[0] if len(matrices) == 1 else StackedMatrix(matrices)


def table_rows(matrix: QuantizedMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a quantized table, float32."""
    if isinstance(matrix, QuantizedTable):
        return matrix.rows(ids)
    return matrix.dequantize()[ids]


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element (zero strides): the float
    parameter of a quantized layer, kept for the code that reads its shape."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.dim() > 0 and all(stride == 0 for stride in tensor.stride())


def quantized_bytes(model: torch.nn.Module) -> int:
    """The bytes of every quantized matrix a model's layers hold (a tied
    embedding and LM head once)."""
    matrices = {
        id(m): m
        for module in model.modules()
        if (m := getattr(module, "quantized", None)) is not None
    }
    return sum(m.nbytes for m in matrices.values())
