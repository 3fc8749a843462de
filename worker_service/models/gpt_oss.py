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

from worker_service.models.config import ModelConfig, MoeConfig
from worker_service.models.config_fields import check_fields
from worker_service.models.family import ModelFamily
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


class GptOssAttention(LlamaAttention):
    """Llama's attention with a biased output projection; the sinks come
    with ``cfg.attention_sinks``."""

    o_proj_bias = True


class GptOssForCausalLM(MoeForCausalLM):
    attention_class = GptOssAttention

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
