"""The mixture-of-experts MLP: a router picks each token's top-k experts
(models/moe_routing.py), the experts run grouped by expert
(models/moe_experts.py), and under tensor parallelism each rank's partial
sums (its shard of every expert's intermediate dimension) are all-reduced.

The router is small (experts x hidden) and whole on every rank: each rank
routes every token the same way, so no routing is exchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import Kernels
from worker_service.models.config import MoeConfig
from worker_service.models.moe_experts import MoeExperts
from worker_service.models.moe_routing import route


class MoeRouter(nn.Module):
    def __init__(
        self, hidden_size: int, moe: MoeConfig, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.moe = moe
        shape = (moe.num_experts, hidden_size)
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = None
        if moe.router_bias:
            bias = torch.empty(moe.num_experts, dtype=dtype, device=device)
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, expert ids (T, k))."""
        return route(F.linear(x, self.weight, self.bias), self.moe)

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError("checkpoint has a router bias the model config does not expect")
        target.data.copy_(tensor)


class MoeBlock(nn.Module):
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
        """``fused``: the experts run through FlashInfer's fused MoE."""
        super().__init__()
        self.tp = tp
        self.router = MoeRouter(hidden_size, moe, dtype=dtype, device=device)
        self.experts = MoeExperts(
            hidden_size, moe, tp=tp, dtype=dtype, device=device, kernels=kernels, fused=fused
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))
