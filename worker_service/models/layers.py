"""Tensor-parallel building blocks: each rank holds a shard of every matrix.

- column parallel (q/k/v, gate/up): a shard of the output features, no
  communication; q, k, v (and gate, up) are fused into one matmul;
- row parallel (o_proj, down_proj): a shard of the input features, then an
  all-reduce of the partial sums;
- vocabulary parallel embedding and LM head: a shard of the vocabulary rows.

Weights arrive whole (as in the checkpoint) through ``load`` and each layer
keeps its own rows or columns.

A linear may hold a quantized matrix instead of its float weight
(models/quantized.py): ``load`` takes ``QuantizedTensor`` parts as it takes
float ones (the same row and column cuts), and once a layer has all its
parts, forward multiplies by the matrix and the float parameter becomes a
placeholder without memory. Float checkpoints never reach that code.

A linear built with a ``LoraSite`` adds the running step's LoRA deltas
(worker_service/lora/batch.py) when the step has adapter rows: a column
linear to its output shard, a row linear to its partial sums before the
all-reduce (which sums the ranks' partial deltas as it does the base's).

``LayerBuild`` carries what every module of one decoder layer is built with
(placement, kernels, LoRA context and layer index), so a family's hooks take
one argument for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import Kernels
from worker_service.lora.batch import LoraContext, LoraSite
from worker_service.models import cpu_linear
from worker_service.models.quantized import (
    QuantizedMatrix,
    QuantizedTensor,
    fuse_rows,
    is_quantized,
    placeholder,
    table_rows,
)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _quantized_linear(matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
    out = matrix.matmul(x.reshape(-1, matrix.in_features))
    return out.view(*x.shape[:-1], matrix.out_features)


class _Quantizable(nn.Module):
    """The quantized hook every linear shares: ``quantized`` replaces ``weight``."""

    weight: nn.Parameter
    quantized: QuantizedMatrix | None = None
    # A vocabulary shard's matrix may lack the padding rows past the vocabulary.
    _fewer_rows_allowed = False

    def set_quantized(self, matrix: QuantizedMatrix) -> None:
        """Multiply by ``matrix`` from now on; the float weight keeps its shape only."""
        shape = tuple(self.weight.shape)
        rows_ok = matrix.out_features == shape[0] or (
            self._fewer_rows_allowed and matrix.out_features < shape[0]
        )
        if not rows_ok or matrix.in_features != shape[1]:
            raise ValueError(
                f"a quantized matrix of {(matrix.out_features, matrix.in_features)} for a "
                f"weight of {shape}"
            )
        self.quantized = matrix
        self.packed = None
        weight = placeholder(shape, self.weight.dtype, self.weight.device)
        self.weight = nn.Parameter(weight, requires_grad=False)


@dataclass(frozen=True)
class LayerBuild:
    """What every module of decoder layer ``layer`` is built with."""

    tp: TensorParallel
    dtype: torch.dtype
    device: torch.device
    kernels: Kernels
    lora: LoraContext
    layer: int

    def site(self, module: str) -> LoraSite:
        return LoraSite(self.lora, self.layer, module)

    @property
    def linear(self) -> dict[str, Any]:
        """A projection's placement keywords."""
        return {"tp": self.tp, "dtype": self.dtype, "device": self.device}

    @property
    def norm(self) -> dict[str, Any]:
        """A norm's keywords."""
        return {"dtype": self.dtype, "device": self.device, "kernels": self.kernels}


class RMSNorm(nn.Module):
    """RMSNorm through the model's kernels; ``add_forward`` also adds the residual
    stream first (one fused kernel on FlashInfer)."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device, kernels: Kernels
    ) -> None:
        super().__init__()
        self.weight = _param((dim,), dtype, device)
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x); may overwrite x and residual."""
        return self.kernels.add_rmsnorm(x, residual, self.weight, self.eps)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(tensor)


class FusedColumnLinear(_Quantizable):
    """Several column-parallel projections of one input in one matmul
    (``parts``: name -> output features of the whole model)."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        *,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        lora: LoraSite | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.lora = lora
        self.offsets: dict[str, tuple[int, int, int]] = {}  # name -> (start, local size, full)
        start = 0
        for name, full in parts.items():
            local = full // tp.size
            tp.shard(full, name)
            self.offsets[name] = (start, local, full)
            start += local
        self.sizes = [size for _, size, _ in self.offsets.values()]
        self.weight = _param((start, in_features), dtype, device)
        self.bias = _param((start,), dtype, device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # pack_for_cpu()
        # The weight parts loaded so far: a quantized part, or None for float
        # rows already in ``weight``; emptied once the last part is in.
        self._parts: dict[str, QuantizedTensor | None] = {}

    def pack_for_cpu(self) -> None:
        if self.quantized is None:
            self.packed = cpu_linear.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = _quantized_linear(self.quantized, x)
            if self.bias is not None:
                out += self.bias
        elif self.packed is not None:
            out = cpu_linear.linear(x, self.packed, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora is not None and (batch := self.lora.context.batch) is not None:
            batch.column(self.lora.layer, self.lora.module, x, out)
        return out

    def load(self, part: str, kind: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        start, local, _ = self.offsets[part]
        lo = self.tp.rank * local
        if kind == "weight" and is_quantized(tensor):
            assert not isinstance(tensor, torch.Tensor)
            self._parts[part] = tensor.rows(lo, lo + local)
        else:
            assert isinstance(tensor, torch.Tensor)
            target = self.weight if kind == "weight" else self.bias
            if target is None:
                raise ValueError(f"checkpoint has a {part} bias the model config does not expect")
            target.data[start : start + local].copy_(tensor[lo : lo + local])
            if kind == "weight":
                self._parts[part] = None
        if kind == "weight" and len(self._parts) == len(self.offsets):
            if any(p is not None for p in self._parts.values()):
                self._fuse_quantized_parts()
            self._parts = {}

    def _fuse_quantized_parts(self) -> None:
        pieces: list[QuantizedTensor | torch.Tensor] = []
        for name, (start, local, _) in self.offsets.items():
            piece = self._parts[name]
            pieces.append(piece if piece is not None else self.weight.data[start : start + local])
        self.set_quantized(fuse_rows(pieces))


class RowLinear(_Quantizable):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        lora: LoraSite | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.lora = lora
        self.lo, self.hi = tp.shard(in_features, "row-parallel input features")
        self.weight = _param((out_features, self.hi - self.lo), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # pack_for_cpu()

    def pack_for_cpu(self) -> None:
        if self.quantized is None:
            self.packed = cpu_linear.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            partial = _quantized_linear(self.quantized, x)
        elif self.packed is not None:
            partial = cpu_linear.linear(x, self.packed, bias=None)
        else:
            partial = F.linear(x, self.weight)
        if self.lora is not None and (batch := self.lora.context.batch) is not None:
            batch.row(self.lora.layer, self.lora.module, x, partial)
        out = self.tp.all_reduce(partial)
        return out + self.bias if self.bias is not None else out

    def load(self, kind: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        if kind == "weight" and is_quantized(tensor):
            assert not isinstance(tensor, torch.Tensor)
            self.set_quantized(tensor.columns(self.lo, self.hi).matrix())
        elif kind == "weight":
            assert isinstance(tensor, torch.Tensor)
            self.weight.data.copy_(tensor[:, self.lo : self.hi])
        elif self.bias is not None:
            self.bias.data.copy_(tensor)


class VocabEmbedding(_Quantizable):
    """Embedding rows [lo, hi) of the (padded) vocabulary; also the LM head
    when embeddings are tied. A quantized table holds the rows [lo, vocab)
    only: the padding rows are zeros, added back to the logits."""

    _fewer_rows_allowed = True

    def __init__(
        self, vocab: int, dim: int, *, tp: TensorParallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        padded = -(-vocab // tp.size) * tp.size
        self.lo, self.hi = tp.shard(padded, "vocabulary")
        self.weight = _param((self.hi - self.lo, dim), dtype, device)
        self.packed: cpu_linear.PackedWeight | None = None  # pack_for_cpu(): the LM head's copy

    def pack_for_cpu(self) -> None:
        if self.quantized is None:
            self.packed = cpu_linear.pack(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self._quantized_rows(ids)
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def _quantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.quantized is not None
        dtype = self.weight.dtype
        if not self.tp.enabled:
            rows = table_rows(self.quantized, ids.reshape(-1)).to(dtype)
            return rows.view(*ids.shape, -1)
        inside = (ids >= self.lo) & (ids < self.lo + self.quantized.out_features)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        rows = table_rows(self.quantized, local.reshape(-1)).to(dtype).view(*ids.shape, -1)
        return self.tp.all_reduce(rows * inside.unsqueeze(-1).to(dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits (gathered across ranks)."""
        if self.quantized is not None:
            local = _quantized_linear(self.quantized, hidden).float()
            if (pad := self.hi - self.lo - local.shape[-1]) > 0:
                local = F.pad(local, (0, pad))
        elif self.packed is not None:
            local = cpu_linear.linear(hidden, self.packed, bias=None).float()
        else:
            local = F.linear(hidden, self.weight).float()
        return self.tp.all_gather_last_dim(local)[..., : self.vocab]

    def load(self, tensor: torch.Tensor | QuantizedTensor) -> None:
        if is_quantized(tensor):
            assert not isinstance(tensor, torch.Tensor)
            self.set_quantized(tensor.rows(self.lo, min(self.hi, self.vocab)).matrix())
            return
        assert isinstance(tensor, torch.Tensor)
        rows = tensor[self.lo : min(self.hi, self.vocab)]
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)


class ScoreHead(nn.Module):
    """score.weight, whole on every tensor-parallel rank: the final-norm hidden
    states are whole on each, and num_labels rows are too few to shard."""

    def __init__(self, hidden: int, num_labels: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((num_labels, hidden), dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The labels' logits in float32 (``hidden``: [..., hidden_size])."""
        return F.linear(hidden, self.weight).float()

    def load(self, tensor: torch.Tensor) -> None:
        if tensor.shape != self.weight.shape:
            raise ValueError(
                f"score.weight is {tuple(tensor.shape)}, the config says {tuple(self.weight.shape)}"
            )
        self.weight.data.copy_(tensor)
