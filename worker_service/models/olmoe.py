"""OLMoE (OlmoeForCausalLM): Llama attention whose query and key projections
are RMS-normalised over the whole projection (all heads together, before
the split into heads), and a MoE MLP in every layer (softmax, top k,
renormalised iff ``norm_topk_prob``). ``clip_qkv`` is refused unless null
(below).

Under tensor parallelism a rank holds some heads of each projection, so the
norm's mean square is a sum of squares all-reduced across ranks, then
divided by the whole projection's width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_service.device.distributed import TensorParallel
from worker_service.models.config import ModelConfig, MoeConfig
from worker_service.models.config_fields import check_fields
from worker_service.models.family import ModelFamily
from worker_service.models.layers import LayerBuild
from worker_service.models.llama import LlamaAttention
from worker_service.models.moe_config_read import (
    MOE_SUPPORT,
    SHARED_FIELDS,
    expert_count,
    llama_part,
)
from worker_service.models.moe_model import MoeForCausalLM


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a column-parallel projection's full width: this rank
    holds columns [lo, hi) of ``full`` and their weights."""

    def __init__(
        self,
        full: int,
        eps: float,
        *,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full = full
        self.eps = eps
        self.lo, self.hi = tp.shard(full, "normalised projection width")
        self.weight = nn.Parameter(
            torch.empty(self.hi - self.lo, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.enabled:
            square_sum = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
            variance = square_sum / self.full
        else:
            variance = h.pow(2).mean(-1, keepdim=True)  # transformers' op, bit for bit
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(tensor[self.lo : self.hi])


class OlmoeAttention(LlamaAttention):
    """Llama's attention with q and k normed over the whole projection,
    before the split into heads."""

    def qk_norms(self, cfg: ModelConfig, build: LayerBuild) -> tuple[nn.Module, nn.Module]:
        eps = cfg.rms_norm_eps
        return (
            ProjectionRMSNorm(cfg.q_size, eps, **build.linear),
            ProjectionRMSNorm(cfg.kv_size, eps, **build.linear),
        )

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        return q, k


class OlmoeForCausalLM(MoeForCausalLM):
    attention_class = OlmoeAttention


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    check_fields(
        architecture,
        cfg,
        implemented={
            *SHARED_FIELDS,
            "num_experts",
            "norm_topk_prob",
            "hidden_act",
            "attention_bias",
            "clip_qkv",
        },
        required_values={"hidden_act": ("silu",), "attention_bias": (False,), "clip_qkv": (None,)},
    )
    moe = MoeConfig(
        num_experts=expert_count(cfg, "num_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    # The q/k norms over the whole projection are OlmoeAttention's, not qk_norm.
    return llama_part(architecture, cfg, moe=moe)


FAMILY = ModelFamily(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    model_class=OlmoeForCausalLM,
    read_config=read_config,
    support=MOE_SUPPORT,
)
