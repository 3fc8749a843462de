"""Tensor-parallel building blocks: each rank holds a shard of every matrix.

- column parallel (q/k/v, gate/up): a shard of the output features, no
  communication; q, k, v (and gate, up) are fused into one matmul;
- row parallel (o_proj, down_proj): a shard of the input features, then an
  all-reduce of the partial sums;
- vocabulary parallel embedding and LM head: a shard of the vocabulary rows.

Weights arrive whole (as in the checkpoint) through ``load`` and each layer
keeps its own rows or columns.

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


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


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


class FusedColumnLinear(nn.Module):
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

    def pack_for_cpu(self) -> None:
        self.packed = cpu_linear.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out = cpu_linear.linear(x, self.packed, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora is not None and (batch := self.lora.context.batch) is not None:
            batch.column(self.lora.layer, self.lora.module, x, out)
        return out

    def load(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        start, local, _ = self.offsets[part]
        lo = self.tp.rank * local
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {part} bias the model config does not expect")
        target.data[start : start + local].copy_(tensor[lo : lo + local])


class RowLinear(nn.Module):
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
        self.packed = cpu_linear.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            partial = cpu_linear.linear(x, self.packed, bias=None)
        else:
            partial = F.linear(x, self.weight)
        if self.lora is not None and (batch := self.lora.context.batch) is not None:
            batch.row(self.lora.layer, self.lora.module, x, partial)
        out = self.tp.all_reduce(partial)
        return out + self.bias if self.bias is not None else out

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        if kind == "weight":
            self.weight.data.copy_(tensor[:, self.lo : self.hi])
        elif self.bias is not None:
            self.bias.data.copy_(tensor)


class VocabEmbedding(nn.Module):
    """Embedding rows [lo, hi) of the (padded) vocabulary; also the LM head
    when embeddings are tied."""

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
        self.packed = cpu_linear.pack(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits (gathered across ranks)."""
        if self.packed is not None:
            local = cpu_linear.linear(hidden, self.packed, bias=None).float()
        else:
            local = F.linear(hidden, self.weight).float()
        return self.tp.all_gather_last_dim(local)[..., : self.vocab]

    def load(self, tensor: torch.Tensor) -> None:
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
