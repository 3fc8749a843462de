"""Models with the shape of a known one and random weights (``random:<shape>``).

For benchmarks on machines without the weights (the GPU test machine has no
network and takes 64 MiB of files per run): the model's parameters are drawn
in place on the device, nothing is read or downloaded. Tokens from such a
model mean nothing; their cost is what is measured.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from worker_service.models.config import ModelConfig, RopeConfig, UnsupportedModelError

PREFIX = "random:"

SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            theta=500000.0,
            scaling_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        eos_token_ids=(128001, 128008, 128009),
    ),
}


class RandomShape:
    """WeightFiles of a random model: the engine initialises the parameters in
    place (``LlamaForCausalLM.init_random_weights``) instead of loading any."""

    def __init__(self, name: str) -> None:
        if name not in SHAPES:
            raise UnsupportedModelError(
                f"unknown random model shape {name!r}; known: {sorted(SHAPES)}"
            )
        self.name = name
        self.config = SHAPES[name]

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        raise UnsupportedModelError("a random model has no weights to load")

    def tokenizer_files(self) -> dict[str, bytes]:
        raise LookupError(f"the random model {self.name} has no tokenizer")
