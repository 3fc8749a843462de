"""Tiny random Hugging Face mixture-of-experts models, saved as checkpoints (a
few hundred KB each): hidden 64, 4 experts of 32, top 2, 2 layers (GPT-OSS:
one sliding, one full); the LM head sharpened as tiny_hf_models does, so
greedy decoding is meaningful. The routers are scaled up too: near-uniform
router logits would make the top-k choice hinge on rounding."""

from __future__ import annotations

import zlib

import torch
from transformers import AutoModelForCausalLM as HFAuto
from transformers import (
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
)

from tests.worker_service.support.tiny_hf_models import VOCAB

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    num_experts_per_tok=2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

MOE_ARCHITECTURES = {
    "qwen3-moe": (
        Qwen3MoeConfig,
        {"num_experts": 4, "moe_intermediate_size": 32, "intermediate_size": 128, "head_dim": 32},
    ),
    "qwen3-moe-normalised": (
        Qwen3MoeConfig,
        {
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "intermediate_size": 128,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (MixtralConfig, {"num_local_experts": 4, "intermediate_size": 32}),
    "mixtral-sliding-window": (
        MixtralConfig,
        {"num_local_experts": 4, "intermediate_size": 32, "sliding_window": 16},
    ),
    "olmoe": (OlmoeConfig, {"num_experts": 4, "intermediate_size": 32}),
    # Sliding window 8: every prompt outgrows it.
    "gpt-oss": (
        GptOssConfig,
        {
            "num_local_experts": 4,
            "intermediate_size": 32,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 128,
                "truncate": False,
            },
        },
    ),
}


def tiny_moe_model(name: str, path) -> PreTrainedModel:
    cls, extra = MOE_ARCHITECTURES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    cfg = cls(**COMMON, **extra)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = HFAuto.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name_, param in model.named_parameters():
            # transformers initialises some routers to zeros (every expert tied).
            if name_.endswith(("mlp.gate.weight", "router.weight")):
                param.normal_(0.0, 0.5)
            elif ("experts" in name_ or name_.endswith("sinks")) and param.abs().sum() == 0:
                param.normal_(0.0, 0.05)
    # Sharded, as large checkpoints are: model.safetensors.index.json + shards.
    model.save_pretrained(path, max_shard_size="300KB")
    return model
