"""Mixtral (MixtralForCausalLM): Mistral's attention (optional sliding
window) with a MoE MLP in every layer: softmax over all experts, top k,
always renormalised; experts named w1 (gate), w3 (up), w2 (down) under
``block_sparse_moe``.

``router_jitter_noise`` is accepted and ignored: transformers applies it in
training mode only. ``hidden_act`` other than silu is refused, as is any
field not read here (models/config_fields.py)."""

from __future__ import annotations

from typing import Any

from worker_service.models.config import ModelConfig, MoeConfig
from worker_service.models.config_fields import check_fields
from worker_service.models.family import ModelFamily
from worker_service.models.moe_config_read import (
    MOE_GGUF_SUPPORT,
    SHARED_FIELDS,
    expert_count,
    llama_part,
)
from worker_service.models.moe_model import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    pass


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    check_fields(
        architecture,
        cfg,
        implemented={*SHARED_FIELDS, "num_local_experts", "sliding_window", "hidden_act"},
        inert={"router_jitter_noise"},
        required_values={"hidden_act": ("silu",)},
    )
    moe = MoeConfig(
        num_experts=expert_count(cfg, "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,  # MixtralTopKRouter always renormalises
    )
    return llama_part(architecture, cfg, sliding_window=cfg.get("sliding_window"), moe=moe)


FAMILY = ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_class=MixtralForCausalLM,
    read_config=read_config,
    support=MOE_GGUF_SUPPORT,
)
