"""Tiny random Hugging Face models of each architecture the worker serves,
saved as checkpoints: the same weights for the same name, with a sharpened
LM head so that greedy decoding is meaningful."""

from __future__ import annotations

import zlib

import torch
from transformers import AutoModelForCausalLM as HFAuto
from transformers import (
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

ARCHITECTURES = {
    "llama3-rope-scaling": (
        LlamaConfig,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama2-linear-rope": (LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2-qkv-bias": (Qwen2Config, {}),
    "qwen3-qk-norm": (Qwen3Config, {"head_dim": 32}),
    "smollm2-tied": (LlamaConfig, {"tie_word_embeddings": True}),
}

# Sliding-window models, served from two KV pools (apart: a plan for them
# carries sliding pages, which plan_driver.py does not make).
SLIDING_WINDOW = 8
SLIDING_ARCHITECTURES = {
    "mistral-sliding": (MistralConfig, {"sliding_window": SLIDING_WINDOW, "num_hidden_layers": 3}),
    # Layers alternating sliding and full attention (GPT-OSS's pattern), which
    # transformers' Qwen2 reads from layer_types (the worker: with_layer_types).
    "qwen2-alternating": (
        Qwen2Config,
        {
            "use_sliding_window": True,
            "sliding_window": SLIDING_WINDOW,
            "max_window_layers": 0,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
}


def tiny_model(name: str, path) -> PreTrainedModel:
    cls, extra = {**ARCHITECTURES, **SLIDING_ARCHITECTURES}[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    cfg = cls(**(COMMON | extra))
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = HFAuto.from_config(cfg, dtype=torch.float32).eval()
    # Random init gives near-uniform logits where argmax ties are fragile; a
    # sharper head makes greedy decoding meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return model
