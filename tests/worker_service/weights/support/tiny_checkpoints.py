"""Tiny random transformers models of each architecture the weight readers
know (every parameter random, norms and biases too, so that a swapped or
transposed tensor cannot pass), the state dict a checkpoint of one holds, and
the check that two state dicts are equal."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama-untied": (LlamaConfig, {"tie_word_embeddings": False, "rope_theta": 5e5}),
    "llama-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, {"head_dim": 32, "tie_word_embeddings": False}),
}


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    config_class, extra = CONFIGS[kind]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**TINY, **extra))
    model.config.architectures = [type(model).__name__]  # set by save_pretrained otherwise
    # Norms start at ones and biases at zeros: randomise everything so a
    # swapped or transposed tensor cannot pass unnoticed.
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    return model.eval()


def expected_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
