"""The Phi-3 family (``Phi3ForCausalLM``): a Llama-shaped model whose
checkpoint fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``,
with Phi-3's longrope RoPE scaling (models/rope.py) and, where the config
asks (Phi-4-mini), partial rotary embeddings. The fused tensors are
split at load into the parts of our own fused layers, so each
tensor-parallel rank keeps its shard of q, k and v (and gate and up) as in
any Llama-family model; the forward is Llama's.

LoRA: Phi-3 adapters target the checkpoint's fused ``qkv_proj`` /
``gate_up_proj``; the adapter loader reads each as one adapter per part
(lora/adapter.py), the same deltas.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.config_fields import SHAPE_FIELDS, check_fields
from worker_service.models.family import FamilySupport, ModelFamily
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.rope_fields import rope_of

PHI3 = "Phi3ForCausalLM"


class Phi3ForCausalLM(LlamaForCausalLM):
    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers" and parts[3] in ("qkv_proj", "gate_up_proj"):
            layer, kind = self.layers[int(parts[1])], parts[-1]
            cfg = self.config
            if parts[3] == "qkv_proj":
                q, k, v = tensor.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
                for part, piece in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    layer.self_attn.qkv_proj.load(part, kind, piece)
            else:
                gate, up = tensor.split([cfg.intermediate_size] * 2, dim=0)
                layer.mlp.gate_up_proj.load("gate_proj", kind, gate)
                layer.mlp.gate_up_proj.load("up_proj", kind, up)
        else:
            super()._load_one(name, tensor)


_IMPLEMENTED = (
    *SHAPE_FIELDS,
    "hidden_act",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "sliding_window",
    "attention_bias",
)
# Training-time dropouts.
_INERT = ("resid_pdrop", "embd_pdrop")


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    check_fields(
        architecture,
        cfg,
        implemented=_IMPLEMENTED,
        inert=_INERT,
        required_values={"hidden_act": ("silu",), "attention_bias": (False,)},
    )
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    max_positions = cfg.get("max_position_embeddings", 4096)
    params = {"rope_theta": cfg.get("rope_theta", 10000.0)}
    params.update(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    # transformers reads Phi-3's "su" and "yarn" as longrope.
    kind = params.pop("type", None) or params.get("rope_type")
    if kind in ("su", "yarn", "longrope"):
        params["rope_type"] = "longrope"
        params.setdefault(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
        )
    elif kind is not None:
        params["rope_type"] = kind
    rope = rope_of(architecture, params, max_positions=max_positions)
    rotary = int(head_dim * rope.partial_rotary_factor)
    for factors in (rope.short_factor, rope.long_factor):
        if factors is not None and len(factors) != rotary // 2:
            raise UnsupportedModelError(
                f"{architecture}: longrope has {len(factors)} factors, {rotary} rotary dims "
                f"need {rotary // 2}"
            )
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope=rope,
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        sliding_window=cfg.get("sliding_window"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


FAMILY = ModelFamily(
    name="phi3",
    architectures=(PHI3,),
    model_class=Phi3ForCausalLM,
    read_config=read_config,
    support=FamilySupport(gguf=True),
)
