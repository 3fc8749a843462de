"""The shape of a model, read from a Hugging Face config or GGUF.

One dataclass covers every family the worker serves. The Llama family (Llama
2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) differs only in flags (qkv bias,
qk-norm, tied embeddings, RoPE scaling, sliding window); the other families
(models/family.py) set the fields after ``score_head``, which default to the
Llama family's behaviour. ``ModelConfig.from_hf`` reads the Llama family;
each other family reads its own config.json (its ``read_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker_service.models.score_head import (
    SEQUENCE_CLASSIFIERS,
    ScoreHeadConfig,
    UnsupportedScoreHeadError,
    score_head_from_hf,
)

# What each architecture implies beyond its config fields.
ARCHITECTURE_TRAITS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # None | "linear" | "llama3" | "yarn"; see models/rope.py
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # llama.cpp stores Llama 3.1 scaling as one divisor per frequency (GGUF).
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class SamplingDefaults:
    """The model author's sampling defaults (generation_config.json, or a
    GGUF file's general.sampling.* keys); None: not declared. Clients get
    them in GetModelInfo, and requests that leave a field unset get them."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP (models/moe.py); every layer has one unless
    the family says otherwise."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # "softmax_topk": softmax over all experts, then the top k (renormalised
    # iff norm_topk_prob); "topk_softmax": the top k router logits, then a
    # softmax over those k (GPT-OSS).
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    # GPT-OSS's clamped SwiGLU: gate clamped above at the limit, up to
    # [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None  # the tokenizer's pad token, else config.json's
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # A sequence classifier's score head (models/score_head.py); None: a
    # causal LM, whose LM head generates.
    score_head: ScoreHeadConfig | None = None
    # --- set by families other than Llama's (models/family.py)
    # One per layer, FULL_ATTENTION or SLIDING_ATTENTION (transformers'
    # names); empty: every layer uses ``sliding_window`` (None: full).
    layer_types: tuple[str, ...] = ()
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    rope_local: RopeConfig | None = None  # the sliding layers' RoPE where it differs
    embed_scale: float | None = None  # embeddings multiplied by it (in the model dtype)
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh" (the gated MLP's activation)
    attention_sinks: bool = False  # a learned per-head sink logit in every softmax
    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads do not group into {self.num_kv_heads} KV heads"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}"
            )
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError("sliding_attention layers need a sliding_window")

    def window_of(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens (None: full attention)."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.window_of(i) is not None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` (transformers 4 or 5 spelling)."""
        archs = cfg.get("architectures") or []
        served = {**ARCHITECTURE_TRAITS, **dict.fromkeys(SEQUENCE_CLASSIFIERS)}
        arch = next((a for a in archs if a in served), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs} are not supported; radixserve serves {sorted(served)}"
            )
        traits = ARCHITECTURE_TRAITS[SEQUENCE_CLASSIFIERS.get(arch, arch)]
        score_head = None
        if arch in SEQUENCE_CLASSIFIERS:
            try:
                score_head = score_head_from_hf(cfg)
            except UnsupportedScoreHeadError as err:
                raise UnsupportedModelError(str(err)) from err
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope_from_hf(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=traits.get("qkv_bias", cfg.get("attention_bias", False)),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=traits.get("qk_norm", False),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            score_head=score_head,
        )


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """transformers 5 writes ``rope_parameters``; older configs ``rope_theta``
    and ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return RopeConfig(theta=theta)
    if kind not in ("linear", "llama3", "yarn"):
        raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported")
    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"),
    )
