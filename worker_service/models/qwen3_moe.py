"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm,
no biases) with a MoE MLP in every layer: softmax over all experts, top k,
renormalised iff ``norm_topk_prob``.

Refused by name: ``mlp_only_layers`` non-empty and ``decoder_sparse_step``
other than 1 (dense layers between sparse ones), ``use_sliding_window``
(Qwen's per-layer window rule), ``attention_bias``, ``hidden_act`` other
than silu, and any field not read here (models/config_fields.py).
``sliding_window`` and ``max_window_layers`` are read by transformers only
with ``use_sliding_window``, so they are inert here."""

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


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    check_fields(
        architecture,
        cfg,
        implemented={
            *SHARED_FIELDS,
            "num_experts",
            "num_local_experts",
            "moe_intermediate_size",
            "norm_topk_prob",
            "hidden_act",
            "mlp_only_layers",
            "decoder_sparse_step",
            "use_sliding_window",
            "attention_bias",
        },
        inert={"sliding_window", "max_window_layers"},
        required_values={
            "hidden_act": ("silu",),
            "mlp_only_layers": ([],),
            "decoder_sparse_step": (1,),
            "use_sliding_window": (False,),
            "attention_bias": (False,),
        },
    )
    moe = MoeConfig(
        num_experts=expert_count(cfg, "num_experts", "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    return llama_part(architecture, cfg, qk_norm=True, moe=moe)


FAMILY = ModelFamily(
    name="qwen3-moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_class=Qwen3MoeForCausalLM,
    read_config=read_config,
    support=MOE_GGUF_SUPPORT,
)
