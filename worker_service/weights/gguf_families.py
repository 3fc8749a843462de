"""GGUF metadata of the Gemma 2, Gemma 3 and Phi-3 families as the config.json
their family's ``read_config`` reads, so a GGUF file is checked and read by
the same code as the Hugging Face directory it was converted from.

What the GGUF lacks is filled in the way llama.cpp does when it loads one
(llama-model.cpp), so that we run what llama.cpp runs:

- Gemma's query scale: not in the file; llama.cpp takes head_dim, or
  hidden / heads for the 27B models (recognised by their layer count), which
  is what those checkpoints' ``query_pre_attn_scalar`` says;
- Gemma's layer pattern: every 2nd (Gemma 2) or 6th (Gemma 3) layer global,
  unless the file names one (``attention.sliding_window_pattern``); Gemma 3
  without ``attention.sliding_window`` is all global;
- Gemma 3's sliding layers rotate with base 10000 and no scaling (llama.cpp's
  constant; ``rope.freq_base_swa`` where the file has one), the global ones
  with ``rope.freq_base`` and the file's linear scaling.

Phi-3's longrope factors are tensors (``rope_factors_long/short.weight``).

Mixture-of-experts files: ``qwen3moe`` (llama.cpp renormalises its top-k
weights, as every published Qwen3-MoE config asks: ``norm_topk_prob``) and
Mixtral, written as ``llama`` with ``expert_count`` (its expert width is
``feed_forward_length``, as in config.json).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from worker_service.models.config import FULL_ATTENTION, SLIDING_ATTENTION, UnsupportedModelError

GEMMA_LAYER_PERIOD = {"gemma2": 2, "gemma3": 6}
# llama.cpp's 27B types, whose query scale is hidden / heads.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"


def family_hf_config(
    get: Any, arch: str, shape: dict[str, Any], rope_tensors: dict[str, np.ndarray]
) -> dict[str, Any]:
    """``get(key, default)`` reads a metadata key; ``shape`` holds the fields
    every architecture has, already in config.json's names."""
    if arch in GEMMA_LAYER_PERIOD:
        return {**shape, **_gemma(get, arch, shape)}
    if arch == "phi3":
        return {**shape, **_phi3(get, shape, rope_tensors)}
    if get(f"{arch}.expert_count"):
        return {**shape, **_moe(get, arch)}
    raise UnsupportedModelError(f"GGUF architecture {arch!r} has no family reader")


def _gemma(get: Any, arch: str, shape: dict[str, Any]) -> dict[str, Any]:
    layers = shape["num_hidden_layers"]
    window = get(f"{arch}.attention.sliding_window")
    if arch == "gemma2" and window is None:
        window = 4096  # llama.cpp's default for Gemma 2
    pattern = get(f"{arch}.attention.sliding_window_pattern")
    if not window:
        layer_types = [FULL_ATTENTION] * layers
    elif isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(
                f"{arch}.attention.sliding_window_pattern names {len(pattern)} layers of {layers}"
            )
        layer_types = [SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern]
    else:
        every = int(pattern or GEMMA_LAYER_PERIOD[arch])
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(layers)
        ]
    heads, hidden = shape["num_attention_heads"], shape["hidden_size"]
    big = layers == GEMMA_27B_LAYERS[arch]
    cfg: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if big else shape["head_dim"],
        "final_logit_softcapping": get(f"{arch}.final_logit_softcapping") or None,
        "attn_logit_softcapping": get(f"{arch}.attn_logit_softcapping") or None,
    }
    theta = float(get(f"{arch}.rope.freq_base", 10000.0))
    if arch == "gemma2":
        cfg["rope_theta"] = theta
        return cfg
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = get(f"{arch}.rope.scaling.type", "none")
    factor = float(get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear" and factor != 1.0:
        full.update(rope_type="linear", factor=factor)
    elif kind not in ("none", "linear"):
        raise UnsupportedModelError(f"{arch}: GGUF RoPE scaling {kind!r} is not supported")
    local = {"rope_type": "default", "rope_theta": float(get(f"{arch}.rope.freq_base_swa", 1e4))}
    cfg["rope_parameters"] = {FULL_ATTENTION: full, SLIDING_ATTENTION: local}
    return cfg


def _phi3(get: Any, shape: dict[str, Any], rope_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    head_dim = shape["head_dim"]
    # rope.dimension_count is the rotary width (Phi-4-mini rotates part of the head).
    rotary = int(get("phi3.rope.dimension_count", head_dim))
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(get("phi3.rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary / head_dim,
    }
    long, short = rope_tensors.get(ROPE_FACTORS_LONG), rope_tensors.get(ROPE_FACTORS_SHORT)
    if (long is None) != (short is None):
        raise UnsupportedModelError("phi3: GGUF has one of the two longrope factor tensors")
    cfg: dict[str, Any] = {
        "hidden_act": "silu",
        "attention_bias": False,
        # The converter writes 0 where config.json had none.
        "sliding_window": get("phi3.attention.sliding_window") or None,
    }
    if long is not None:
        original = int(get("phi3.rope.scaling.original_context_length"))
        factor = shape["max_position_embeddings"] / original
        params.update(
            rope_type="longrope",
            long_factor=[float(f) for f in long.reshape(-1)],
            short_factor=[float(f) for f in short.reshape(-1)],
            original_max_position_embeddings=original,
        )
        # The converter writes transformers' default magnitude scale; another
        # value is the file's own and replaces it.
        attn = get("phi3.rope.scaling.attn_factor")
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        if attn is not None and not math.isclose(float(attn), default, rel_tol=1e-6):
            params["attention_factor"] = float(attn)
    cfg["rope_parameters"] = params
    return cfg


def _moe(get: Any, arch: str) -> dict[str, Any]:
    kind = get(f"{arch}.rope.scaling.type", "none")
    if kind != "none" and not (kind == "linear" and get(f"{arch}.rope.scaling.factor") == 1.0):
        raise UnsupportedModelError(f"GGUF {arch!r} mixture of experts with RoPE scaling {kind!r}")
    cfg: dict[str, Any] = {
        "num_experts_per_tok": int(get(f"{arch}.expert_used_count")),
        "hidden_act": "silu",
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
    }
    count = int(get(f"{arch}.expert_count"))
    if arch == "qwen3moe":
        if get("qwen3moe.expert_weights_norm", True) is not True:
            raise UnsupportedModelError("GGUF qwen3moe with expert_weights_norm false")
        cfg.update(
            num_experts=count,
            moe_intermediate_size=int(get("qwen3moe.expert_feed_forward_length")),
            norm_topk_prob=True,
        )
    else:
        cfg["num_local_experts"] = count
    return cfg
