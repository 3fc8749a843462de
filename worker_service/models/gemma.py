"""The Gemma family: Gemma 2 and Gemma 3 (text), one implementation.

What differs from the Llama family (transformers' Gemma2/Gemma3 modules):

- embeddings multiplied by sqrt(hidden), the factor rounded to the model
  dtype first (``config.embed_scale``);
- Gemma's RMSNorm, ``x / RMS(x) * (1 + w)`` with the weight and the product
  in float32 (kernel ops ``gemma_rmsnorm`` / ``gemma_add_rmsnorm``: the
  checkpoint's w is kept as it is, so a bf16 model rounds once, as
  transformers does, instead of rounding 1 + w into bf16);
- four norms per layer: the attention's and the MLP's outputs are normed
  before they join the residual stream (post-attention and post-feed-forward
  norms), and the MLP's input has its own (pre-feed-forward) norm;
- GeGLU MLP (``gelu_tanh_and_mul``);
- attention scale ``query_pre_attn_scalar ** -0.5`` (``config.attn_scale``),
  attention logit soft-capping (Gemma 2), interleaved sliding and global
  layers (``config.layer_types``): the attention backend the forward is given
  applies them (attention/layer_groups.py dispatches by layer);
- Gemma 3: query/key norms (Gemma's RMSNorm over head_dim) and the sliding
  layers' own RoPE base (``config.rope_local``);
- final-logit soft-capping (Gemma 2), applied by ``LlamaForCausalLM.logits``.

The decoder loop keeps Llama's fused residual-add-and-norm shape:

    residual = embed(ids) * scale;  x = input_norm_0(residual)
    per layer i:  out = post_attn_norm_i(attn_i(x))
                  residual += out;  x = pre_ff_norm_i(residual)
                  out = post_ff_norm_i(mlp_i(x))
                  residual += out;  x = input_norm_{i+1}(residual)  (final norm)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.device.kv_cache import KvCache
from worker_service.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    UnsupportedModelError,
)
from worker_service.models.config_fields import SHAPE_FIELDS, check_fields
from worker_service.models.family import FamilySupport, ModelFamily
from worker_service.models.layers import LayerBuild, RMSNorm
from worker_service.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from worker_service.models.rope import RotaryEmbedding
from worker_service.models.rope_fields import rope_of

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
# The multimodal Gemma 3 (a vision tower and projector beside the text model):
# its text part is a Gemma3ForCausalLM, the rest is not served.
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm through the model's kernels (``x / RMS(x) * (1 + w)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gemma_rmsnorm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x); may overwrite x and residual."""
        return self.kernels.gemma_add_rmsnorm(x, residual, self.weight, self.eps)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's query/key norms (Gemma 3); the scale,
    soft-cap and window are the attention backend's (its spec per layer group)."""

    qk_norm_class = GemmaRMSNorm


class GemmaMLP(LlamaMLP):
    """GeGLU: ``down(gelu_tanh(gate) * up)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.gelu_tanh_and_mul(self.gate_up_proj(x)))


NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class GemmaDecoderLayer(nn.Module):
    """Gemma's four norms around the attention and MLP its model built."""

    def __init__(
        self, cfg: ModelConfig, attention: nn.Module, mlp: nn.Module, build: LayerBuild
    ) -> None:
        super().__init__()
        on = build.norm
        for name in NORMS:
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **on))
        self.self_attn = attention
        self.mlp = mlp


class GemmaForCausalLM(LlamaForCausalLM):
    attention_class = GemmaAttention
    mlp_class = GemmaMLP
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        kernels = self.kernels
        # One RoPE table per layer: the sliding layers' own where it differs.
        self.rope_local = self.rope
        if cfg.rope_local is not None and cfg.rope_local != cfg.rope:
            self.rope_local = RotaryEmbedding(
                cfg, self.embed_tokens.weight.device, kernels, rope=cfg.rope_local
            )
        self.layer_ropes = [
            self.rope_local if cfg.window_of(i) is not None else self.rope
            for i in range(cfg.num_layers)
        ]
        # transformers multiplies by the scale rounded to the model dtype; on the
        # model's device (a host copy per forward would break graph capture).
        self.embed_scale = torch.tensor(
            cfg.embed_scale or 1.0, dtype=self.dtype, device=self.embed_tokens.weight.device
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv: KvCache,
    ) -> torch.Tensor:
        residual = self.embed_tokens(input_ids) * self.embed_scale
        layers = self.layers
        if not layers:
            return self.norm(residual)
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            rope = self.layer_ropes[i]
            out = layer.self_attn(i, positions, x, rope=rope, attn=attn, kv=kv)
            out = layer.post_attention_layernorm(out)
            x, residual = layer.pre_feedforward_layernorm.add_forward(out, residual)
            out = layer.post_feedforward_layernorm(layer.mlp(x))
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, residual = next_norm.add_forward(out, residual)
        return x

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> None:
        """As Llama's, but Gemma's norms multiply by 1 + w: w = 0 is the unit norm."""
        super().init_random_weights(seed)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.zero_()

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers" and parts[2] in NORMS:
            getattr(self.layers[int(parts[1])], parts[2]).load(parts[-1], tensor)
        else:
            super()._load_one(name, tensor)


# ------------------------------------------------------------------ config.json

_IMPLEMENTED = (
    *SHAPE_FIELDS,
    "hidden_activation",
    "hidden_act",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "rope_local_base_freq",
    "attention_bias",
    "query_pre_attn_scalar",
    "sliding_window",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
)
# Generation-time knobs of transformers' own cache; nothing to compute.
_INERT = ("cache_implementation",)
# Every layer-type pattern transformers derives when a config has no layer_types:
# every n-th layer global (Gemma 2: n = 2, Gemma 3: n = 6).
_DEFAULT_PATTERN = {GEMMA2: 2, GEMMA3: 6}


def read_config(architecture: str, cfg: dict[str, Any]) -> ModelConfig:
    act = ("gelu_pytorch_tanh",)
    check_fields(
        architecture,
        cfg,
        implemented=_IMPLEMENTED,
        inert=_INERT,
        required_values={
            "hidden_activation": act,
            "hidden_act": act,
            "use_bidirectional_attention": (False, None),
            # transformers' Gemma 3 never applies it (its attention takes no
            # soft-cap): refused rather than guessed at.
            **({"attn_logit_softcapping": (None,)} if architecture == GEMMA3 else {}),
        },
    )
    num_layers = cfg["num_hidden_layers"]
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    layer_types = tuple(cfg.get("layer_types") or ())
    if not layer_types:
        every = (
            cfg.get("sliding_window_pattern")
            or cfg.get("_sliding_window_pattern")
            or _DEFAULT_PATTERN[architecture]
        )
        layer_types = tuple(
            SLIDING_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(num_layers)
        )
    sliding = cfg.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    rope, rope_local = _ropes(architecture, cfg)
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=rope,
        rope_local=rope_local,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=architecture == GEMMA3,
        sliding_window=sliding,
        layer_types=layer_types,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        embed_scale=math.sqrt(hidden),
        hidden_act="gelu_pytorch_tanh",
    )


def _ropes(architecture: str, cfg: dict[str, Any]):
    """(the global layers' RoPE, the sliding layers' where it differs). Gemma 3
    in transformers 5 spells them ``rope_parameters`` per layer type; older
    configs ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if architecture == GEMMA2 or not any(k in params for k in (FULL_ATTENTION, SLIDING_ATTENTION)):
        full = {"rope_theta": cfg.get("rope_theta", 10000.0 if architecture == GEMMA2 else 1e6)}
        full.update(cfg.get("rope_scaling") or {})
        full.update({k: v for k, v in params.items() if not isinstance(v, dict)})
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    else:
        full = dict(params.get(FULL_ATTENTION) or {"rope_theta": 1e6})
        local = dict(params.get(SLIDING_ATTENTION) or {"rope_theta": 10000.0})
    rope = rope_of(architecture, full)
    local_rope = None if architecture == GEMMA2 else rope_of(architecture, local)
    if any(r is not None and r.partial_rotary_factor != 1.0 for r in (rope, local_rope)):
        # transformers' Gemma rotates every dim whatever the factor says.
        raise UnsupportedModelError(f"{architecture}: partial_rotary_factor is not supported")
    return rope, local_rope


# Architectures of this family's checkpoints that are refused, and why.
REFUSED = {
    GEMMA3_MULTIMODAL: (
        "Gemma 3 with its vision tower is not supported; radixserve serves "
        f"Gemma 3's text model ({GEMMA3})"
    )
}

FAMILY = ModelFamily(
    name="gemma",
    architectures=(GEMMA2, GEMMA3),
    model_class=GemmaForCausalLM,
    read_config=read_config,
    support=FamilySupport(gguf=True),
)
