"""A ModelConfig from a GGUF file's metadata (llama.cpp's key names).

A GGUF file has no config.json: the ``{arch}.*`` keys are the config. The
llama.cpp architectures we serve map to HF architectures like this (Mistral
and SmolLM2 files are written as ``llama``); the Gemma and Phi-3 files are
read by their family's config reader (weights/gguf_families.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import gguf
import numpy as np

from worker_service.models.config import (
    ARCHITECTURE_TRAITS,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from worker_service.weights.declarations import gguf_sampling_defaults
from worker_service.weights.gguf_families import family_hf_config

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Read through their family's config reader (models/gemma.py, models/phi3.py).
FAMILY_GGUF_ARCHITECTURES = frozenset({"gemma2", "gemma3", "phi3", "qwen3moe"})
# llama.cpp's names of the MoE architectures served from HF directories only.
GGUF_MOE_ARCHITECTURES = ("olmoe", "gpt-oss")
# The MoE files we read: Qwen3-MoE, and Mixtral (written as "llama" with
# expert_count and ffn_*_exps tensors).
GGUF_MOE_READ = {"qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM"}


class GgufMetadata:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader: gguf.GGUFReader, source: str) -> None:
        self._fields = reader.fields
        self._source = source

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise UnsupportedModelError(f"{self._source}: GGUF metadata lacks {key!r}")
        return self.get(key)

    def count(self, key: str) -> int:
        """Length of an array field without materialising it (the token list
        has ~50k-150k strings)."""
        field = self._fields.get(key)
        return 0 if field is None else len(field.data)


def gguf_model_config(
    meta: GgufMetadata,
    tensor_names: Collection[str],
    vocab_rows: int,
    freq_factors: np.ndarray | None,
    *,
    rope_tensors: dict[str, np.ndarray] | None = None,
) -> ModelConfig:
    """Build the config; ``vocab_rows`` is the embedding's row count, the last
    resort for the vocabulary size; ``rope_tensors``: Phi-3's longrope factors
    by tensor name."""
    arch = meta.require("general.architecture")
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    shared = int(meta.get(f"{arch}.expert_shared_count", 0) or 0)
    if arch in GGUF_MOE_ARCHITECTURES or (experts > 0 and (arch not in GGUF_MOE_READ or shared)):
        raise UnsupportedModelError(
            f"GGUF mixture-of-experts models ({arch!r}, "
            f"{arch}.expert_count={meta.get(f'{arch}.expert_count')}, shared experts {shared}) "
            "are not supported (GGUF MoE: qwen3moe, and Mixtral as llama); "
            "serve the Hugging Face directory (safetensors) instead"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; "
            f"radixserve reads {sorted(GGUF_ARCHITECTURES)}"
        )
    architecture = GGUF_MOE_READ[arch] if experts > 0 else GGUF_ARCHITECTURES[arch]
    traits = ARCHITECTURE_TRAITS.get(architecture, {})

    def key(name: str) -> Any:
        return meta.require(f"{arch}.{name}")

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    # head_count_kv is absent when it equals head_count (no GQA).
    num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
    # key_length is written when config.json had head_dim; the Llama-family
    # architectures rotate the whole head, so the rotary width is one too
    # (Phi-3's rotary width can be part of the head).
    head_dim = (
        meta.get(f"{arch}.attention.key_length")
        or (None if arch == "phi3" else meta.get(f"{arch}.rope.dimension_count"))
        or hidden // num_heads
    )
    vocab = meta.get(f"{arch}.vocab_size") or meta.count("tokenizer.ggml.tokens") or vocab_rows

    eos_ids: list[int] = []
    # eot/eom end a turn in chat models (llama.cpp stops on them too).
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{name}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")

    names = set(tensor_names)
    declared = dict(
        eos_token_ids=tuple(eos_ids),
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=None if pad is None else int(pad),
        sampling_defaults=gguf_sampling_defaults(meta.get),
    )
    if arch in FAMILY_GGUF_ARCHITECTURES or experts > 0:
        if freq_factors is not None:
            raise UnsupportedModelError(f"GGUF {arch!r} with rope_freqs.weight is not supported")
        from worker_service.models.registry import family_of  # the models import torch

        shape = {
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": int(head_dim),
            "vocab_size": int(vocab),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
            # llama.cpp writes output.weight only when it differs from the embedding.
            "tie_word_embeddings": "output.weight" not in names,
        }
        hf = family_hf_config(meta.get, arch, shape, rope_tensors or {})
        config = family_of(architecture).read_config(architecture, hf)
        return dataclasses.replace(config, **declared)
    return ModelConfig(
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope=_rope_config(meta, arch, freq_factors),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        # llama.cpp writes output.weight only when it differs from the embedding.
        tie_word_embeddings="output.weight" not in names,
        # The tensors are the ground truth for biases: the file holds them or not.
        qkv_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names or "blk.0.ffn_up.bias" in names,
        qk_norm=traits.get("qk_norm", False) or "blk.0.attn_q_norm.weight" in names,
        **declared,
    )


def _rope_config(meta: GgufMetadata, arch: str, freq_factors: np.ndarray | None) -> RopeConfig:
    def rope(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.rope.{name}", default)

    theta = float(rope("freq_base", 10000.0))
    factors = None if freq_factors is None else tuple(float(f) for f in freq_factors.reshape(-1))
    kind = rope("scaling.type", "none")
    factor = float(rope("scaling.factor", 1.0))
    original = rope("scaling.original_context_length")
    original = None if original is None else int(original)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeConfig(theta=theta, freq_factors=factors)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=factor, freq_factors=factors)
    if kind == "yarn":
        attention_factor = None
        attn_factor = rope("scaling.attn_factor")
        if attn_factor is not None and float(attn_factor) != 1.0:
            # llama.cpp multiplies YaRN's default magnitude scale by attn_factor;
            # HF's attention_factor replaces that default, so fold it in.
            attention_factor = float(attn_factor) * (0.1 * math.log(factor) + 1.0)
        return RopeConfig(
            theta=theta,
            scaling_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(rope("scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(rope("scaling.yarn_beta_slow", 1.0)),
            attention_factor=attention_factor,
            freq_factors=factors,
        )
    raise UnsupportedModelError(f"GGUF RoPE scaling {kind!r} is not supported")
