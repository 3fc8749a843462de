"""GPT-OSS (GptOssForCausalLM): attention with biased q/k/v/o projections
and a learned sink logit per head (each softmax's denominator gains
exp(sink)), layers alternating sliding-window and full attention
(``layer_types``: the worker gives the forward a GroupedAttention that
dispatches each layer to its group's backend), yarn RoPE; and a MoE MLP in
every layer: the top k of the router's logits (with its bias), a softmax
over those k, experts with biased gate/up and down projections and
transformers' clamped SwiGLU (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7).

The checkpoint stores the experts stacked and transposed, gate and up
interleaved column by column: ``mlp.experts.gate_up_proj`` (E, hidden, 2I),
gate = columns 0, 2, ..., up = 1, 3, ...; ``gate_up_proj_bias`` (E, 2I) the
same way; ``down_proj`` (E, I, hidden) and ``down_proj_bias`` (E, hidden).
They are de-interleaved into the [gate rows | up rows] layout on load.

Refused by name: ``quantization_config`` (the published checkpoints are
MXFP4; a bf16 or fp32 copy serves), ``attention_bias`` false, and any field
not read here (models/config_fields.py). ``hidden_act`` is inert: the
experts' activation is the clamped SwiGLU whatever it says.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache
from worker_service.kernels import Kernels
from worker_service.lora.batch import LoraContext, LoraSite
from worker_service.models.config import ModelConfig, MoeConfig
from worker_service.models.config_fields import check_fields
from worker_service.models.family import ModelFamily
from worker_service.models.layers import RowLinear
from worker_service.models.llama import LlamaAttention
from worker_service.models.moe import MoeBlock
from worker_service.models.moe_config_read import (
    MOE_SUPPORT,
    SHARED_FIELDS,
    expert_count,
    llama_part,
)
from worker_service.models.moe_model import MoeForCausalLM
from worker_service.models.moe_routing import TOPK_SOFTMAX
from worker_service.models.rope import RotaryEmbedding


class GptOssAttention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels,
        lora: LoraContext,
        layer: int,
    ) -> None:
        super().__init__(
            cfg, tp=tp, dtype=dtype, device=device, kernels=kernels, lora=lora, layer=layer
        )
        on = {"tp": tp, "dtype": dtype, "device": device}
        self.o_proj = RowLinear(
            cfg.q_size, cfg.hidden_size, bias=True, lora=LoraSite(lora, layer, "o_proj"), **on
        )
        self.heads_lo, _ = tp.shard(cfg.num_heads, "attention heads")
        # float32, as the backends take them (a sink is one logit per head).
        sinks = torch.empty(self.num_heads, dtype=torch.float32, device=device)
        self.sinks = nn.Parameter(sinks, requires_grad=False)

    def forward(
        self,
        layer: int,
        positions: torch.Tensor,
        x: torch.Tensor,
        *,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        kv: KvCache,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = attn.forward(layer, q, k, v, kv=kv, sinks=self.sinks)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def load_sinks(self, tensor: torch.Tensor) -> None:
        self.sinks.data.copy_(tensor[self.heads_lo : self.heads_lo + self.num_heads])


class GptOssForCausalLM(MoeForCausalLM):
    def attention(
        self,
        cfg: ModelConfig,
        *,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels,
        lora: LoraContext,
        layer: int,
    ) -> nn.Module:
        on = {"tp": tp, "dtype": dtype, "device": device, "kernels": kernels}
        return GptOssAttention(cfg, lora=lora, layer=layer, **on)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.removeprefix("model.").split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["self_attn", "sinks"]:
            self.layers[int(parts[1])].self_attn.load_sinks(tensor)
            return
        super()._load_one(name, tensor)

    def _load_moe(self, block: MoeBlock, parts: list[str], tensor: torch.Tensor, name: str) -> None:
        experts = block.experts
        if parts == ["experts", "gate_up_proj"]:
            # (E, hidden, 2I) interleaved -> per expert (I, hidden) gate and up
            experts.load_stacked("gate", "weight", tensor[:, :, 0::2].transpose(1, 2))
            experts.load_stacked("up", "weight", tensor[:, :, 1::2].transpose(1, 2))
        elif parts == ["experts", "gate_up_proj_bias"]:
            experts.load_stacked("gate", "bias", tensor[:, 0::2])
            experts.load_stacked("up", "bias", tensor[:, 1::2])
        elif parts == ["experts", "down_proj"]:
            experts.load_stacked("down", "weight", tensor.transpose(1, 2))
        elif parts == ["experts", "down_proj_bias"]:
            experts.load_stacked("down", "bias", tensor)
        else:
            super()._load_moe(block, parts, tensor, name)


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    check_fields(
        architecture,
        cfg,
        implemented={
            *SHARED_FIELDS,
            "num_local_experts",
            "sliding_window",
            "layer_types",
            "swiglu_limit",
            "swiglu_alpha",
            "attention_bias",
        },
        # Duplicates of read fields (the original release's names), and the
        # activation the experts do not use.
        inert={"experts_per_token", "initial_context_length", "hidden_act"},
        required_values={"attention_bias": (True,)},
    )
    moe = MoeConfig(
        num_experts=expert_count(cfg, "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        router=TOPK_SOFTMAX,
        norm_topk_prob=False,
        router_bias=True,
        expert_bias=True,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    return llama_part(
        architecture,
        cfg,
        qkv_bias=True,
        sliding_window=cfg.get("sliding_window"),
        layer_types=tuple(cfg.get("layer_types") or ()),
        attention_sinks=True,
        moe=moe,
    )


FAMILY = ModelFamily(
    name="gpt-oss",
    architectures=("GptOssForCausalLM",),
    model_class=GptOssForCausalLM,
    read_config=read_config,
    support=MOE_SUPPORT,
)
