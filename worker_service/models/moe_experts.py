"""The experts of a mixture-of-experts MLP as stacked weights, and their
grouped torch forward.

Layout (one tensor per kind, experts along dim 0):

- ``w13`` (E, 2 * I_local, hidden): each expert's gate rows, then its up
  rows (the layout ``silu_and_mul`` reads); up rows first where FlashInfer's
  fused MoE runs the experts (models/moe_kernel.py), its order;
- ``w2`` (E, hidden, I_local): each expert's down projection;
- ``b13`` (E, 2 * I_local) and ``b2`` (E, hidden) when the experts have
  biases (GPT-OSS).

Tensor parallelism shards every expert's intermediate dimension: rank r
holds gate/up rows and down columns [r * I/n, (r + 1) * I/n) of every
expert, so each rank's down projection is a partial sum the MoE block
all-reduces (as RowLinear does). The down bias is added by rank 0 only, so
the sum counts it once.

The grouped forward sorts the (token, expert) assignments by expert and runs
one gate/up and one down matmul per expert that has tokens; it reads the
counts on the host (one sync per layer), so it is not CUDA-graph safe.
Experts are visited in ascending order and their outputs summed into the
result with ``index_add_``, as transformers does, so fp32 results agree
with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import Kernels
from worker_service.models.config import MoeConfig
from worker_service.models.moe_kernel import FusedMoeCall


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation on [gate | up] (transformers' GptOssExperts._apply_gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoeExperts(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        *,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels,
        fused: bool = False,
    ) -> None:
        """``fused``: run through FlashInfer's fused MoE (models/moe_kernel.py)."""
        super().__init__()
        self.moe = moe
        self.tp = tp
        self.kernels = kernels
        self.lo, self.hi = tp.shard(moe.expert_intermediate_size, "expert intermediate size")
        local = self.hi - self.lo
        self.local = local
        e = moe.num_experts
        self.w13 = _param((e, 2 * local, hidden_size), dtype, device)
        self.w2 = _param((e, hidden_size, local), dtype, device)
        self.b13 = self.b2 = None
        if moe.expert_bias:
            self.b13 = _param((e, 2 * local), dtype, device)
            self.b2 = _param((e, hidden_size), dtype, device)
        # The row order of w13 and b13: FlashInfer's [up | gate] when fused.
        self.up_first = fused
        self.fused: FusedMoeCall | None = None
        if fused:
            self.fused = FusedMoeCall.create(
                e, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit, device=device
            )

    # ------------------------------------------------------------ forward
    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.up_first:
            up, gate = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat([gate, up], dim=-1)
        alpha, limit = self.moe.swiglu_alpha, self.moe.swiglu_limit
        if limit is not None:
            return clamped_swiglu(gate_up, 1.702 if alpha is None else alpha, limit)
        return self.kernels.silu_and_mul(gate_up)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (T, hidden) of sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""
        down_bias = self.b2 is not None and self.tp.rank == 0
        if self.fused is not None and x.shape[0] > 0:
            b2 = self.b2 if down_bias else None
            return self.fused(x, weights, ids, w31=self.w13, w2=self.w2, b31=self.b13, b2=b2)
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            picked = order[start : start + n]
            start += n
            tokens = picked // k
            b13 = self.b13[expert] if self.b13 is not None else None
            h = self.activation(F.linear(x[tokens], self.w13[expert], b13))
            y = F.linear(h, self.w2[expert], self.b2[expert] if down_bias else None)
            y = y * flat_weights[picked, None].to(y.dtype)
            out.index_add_(0, tokens, y)
        return out

    # ------------------------------------------------------------ loading
    def load_expert(self, expert: int, part: str, kind: str, tensor: torch.Tensor) -> None:
        """One expert's whole (unsharded) tensor in HF layout: ``part`` "gate",
        "up" (out = intermediate rows) or "down" (in = intermediate columns);
        ``kind`` "weight" or "bias"."""
        lo, hi, local = self.lo, self.hi, self.local
        if part in ("gate", "up"):
            at = 0 if (part == "gate") != self.up_first else local
            target = self.w13 if kind == "weight" else self.b13
            self._need(target, part, kind)[expert, at : at + local].copy_(tensor[lo:hi])
        elif part == "down":
            if kind == "weight":
                self.w2.data[expert].copy_(tensor[:, lo:hi])
            else:
                self._need(self.b2, part, kind)[expert].copy_(tensor)
        else:
            raise ValueError(f"unknown expert part {part!r}")

    def load_stacked(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """Every expert's tensor at once (dim 0: experts), HF layout per expert."""
        if tensor.shape[0] != self.moe.num_experts:
            raise ValueError(
                f"{part} {kind} holds {tensor.shape[0]} experts, the config says "
                f"{self.moe.num_experts}"
            )
        for expert in range(self.moe.num_experts):
            self.load_expert(expert, part, kind, tensor[expert])

    @staticmethod
    def _need(target: nn.Parameter | None, part: str, kind: str) -> torch.Tensor:
        if target is None:
            raise ValueError(
                f"checkpoint has an expert {part} {kind} the model config does not expect"
            )
        return target.data
