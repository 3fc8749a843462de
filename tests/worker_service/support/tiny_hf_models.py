"""Tiny random Hugging Face models of each architecture the worker serves,
saved as checkpoints: the same weights for the same name, with a sharpened
LM head so that greedy decoding is meaningful."""

from __future__ import annotations

import zlib

import torch
from transformers import AutoModelForCausalLM as HFAuto
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
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
    # Qwen2 reads from layer_types (transformers and the worker alike).
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


# The families beside Llama's (models/gemma.py, models/phi3.py): windows of
# 12-16 tokens, shorter than the prompts, so the sliding layers see less than
# the global ones; a query scale that is not head_dim's; soft-caps small
# enough to bend the scores and logits of a tiny model.
WINDOW = 12
GEMMA = dict(
    COMMON,
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
)
FAMILY_ARCHITECTURES = {
    "gemma2": (
        Gemma2Config,
        "Gemma2ForCausalLM",
        dict(GEMMA, attn_logit_softcapping=0.5, final_logit_softcapping=5.0),
    ),
    "gemma3": (
        Gemma3TextConfig,
        "Gemma3ForCausalLM",
        dict(
            GEMMA,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
    ),
    # Every layer global: what runs without per-layer windows in the backend.
    "gemma3-global": (
        Gemma3TextConfig,
        "Gemma3ForCausalLM",
        dict(GEMMA, layer_types=["full_attention"] * 4),
    ),
    "phi3-longrope": (
        Phi3Config,
        "Phi3ForCausalLM",
        dict(
            COMMON,
            max_position_embeddings=512,
            original_max_position_embeddings=256,
            sliding_window=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0],
            },
        ),
    ),
    # Phi-4-mini's shape: half of each head rotates, tied embeddings.
    "phi3-partial-rotary": (
        Phi3Config,
        "Phi3ForCausalLM",
        dict(COMMON, partial_rotary_factor=0.5, tie_word_embeddings=True),
    ),
    # Gemma as a GGUF file can say it (weights/gguf_families.py): the query
    # scale head_dim's (the file has no query_pre_attn_scalar; llama.cpp takes
    # head_dim below 27B), and Gemma 3's layout llama.cpp's: every 6th layer
    # global, the sliding layers' RoPE base 10000.
    "gemma2-gguf": (
        Gemma2Config,
        "Gemma2ForCausalLM",
        dict(
            GEMMA,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma3-gguf": (
        Gemma3TextConfig,
        "Gemma3ForCausalLM",
        dict(
            GEMMA,
            num_hidden_layers=6,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
            },
        ),
    ),
}


def tiny_model(name: str, path) -> PreTrainedModel:
    torch.manual_seed(zlib.crc32(name.encode()))
    if name in FAMILY_ARCHITECTURES:
        cls, arch, kwargs = FAMILY_ARCHITECTURES[name]
        cfg = cls(**kwargs)
    else:
        cls, extra = {**ARCHITECTURES, **SLIDING_ARCHITECTURES}[name]
        cfg = cls(**(COMMON | extra))
        arch = cls.__name__.replace("Config", "ForCausalLM")
    cfg.architectures = [arch]
    model = HFAuto.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        # Random init gives near-uniform logits where argmax ties are fragile; a
        # sharper head makes greedy decoding meaningful.
        model.lm_head.weight.mul_(8.0)
        if name in FAMILY_ARCHITECTURES:
            # Norm weights drawn too (Gemma's start at 0, i.e. x (1 + 0)), so a
            # norm applied the wrong way shows; sharper queries make attention
            # scores large enough for windows and soft-caps to matter.
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.normal_(0.0, 0.3)
                elif "q_proj" in pname or "qkv_proj" in pname:
                    param.mul_(6.0)
    model.save_pretrained(path)
    return model
