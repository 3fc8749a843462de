"""config.json readers of the mixture-of-experts families: Qwen3-MoE,
Mixtral, OLMoE and GPT-OSS.

Each builds the ``ModelConfig`` its model class runs, and refuses by name
every config.json field that would change the computation in a way the
model does not implement (``check_fields``). Fields that only matter for
training (router aux-loss coefficients, dropout, Mixtral's router jitter
noise, which transformers applies only in training mode) and bookkeeping
(dtype, versions, token ids handled elsewhere) are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.moe_config import CLAMPED_SWIGLU, TOPK_SOFTMAX, MoeConfig

# Read elsewhere or without effect on inference.
COMMON_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_name_or_path",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "num_experts_per_tok",
        # training only
        "output_router_logits",
        "router_aux_loss_coef",
        "attention_dropout",
    }
)

# field -> (what it must be for us to serve the model, the rule in words)
Rule = tuple[Callable[[Any], bool], str]
SILU_ONLY: Rule = (lambda v: v == "silu", '"silu"')
FALSE: Rule = (lambda v: not v, "false")
NULL: Rule = (lambda v: v is None, "null")


def check_fields(
    arch: str, cfg: Mapping[str, Any], *, fields: set[str], rules: dict[str, Rule]
) -> None:
    """Refuse ``cfg`` by the first field that is neither read (``fields``,
    COMMON_FIELDS) nor at a value ``rules`` accepts."""
    for key, value in cfg.items():
        if key in rules:
            ok, wanted = rules[key]
            if not ok(value):
                raise UnsupportedModelError(
                    f"{arch}: config field {key}={value!r} is not implemented (radixserve "
                    f"serves this family with {key} {wanted} only)"
                )
        elif key not in fields and key not in COMMON_FIELDS:
            raise UnsupportedModelError(
                f"{arch}: config field {key!r} is not implemented; radixserve refuses to run "
                "a model it might compute differently"
            )


def _base(arch: str, cfg: Mapping[str, Any], **changes: Any) -> ModelConfig:
    """The attention/embedding part, read as the Llama family reads it."""
    llama = {k: v for k, v in cfg.items() if k not in ("sliding_window", "attention_bias")}
    base = ModelConfig.from_hf({**llama, "architectures": ["LlamaForCausalLM"]})
    return dataclasses.replace(base, architecture=arch, **changes)


def _experts(cfg: Mapping[str, Any], *names: str) -> int:
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    raise UnsupportedModelError(f"config.json lacks the number of experts ({' or '.join(names)})")


def read_qwen3_moe(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    check_fields(
        arch,
        cfg,
        fields={"num_experts", "num_local_experts", "moe_intermediate_size", "norm_topk_prob"},
        rules={
            "hidden_act": SILU_ONLY,
            "attention_bias": FALSE,
            "mlp_only_layers": (lambda v: not v, "[] (every layer sparse)"),
            "decoder_sparse_step": (lambda v: v == 1, "1 (every layer sparse)"),
            "use_sliding_window": FALSE,
            # Only read with use_sliding_window, which is refused above.
            "sliding_window": (lambda v: True, "any"),
            "max_window_layers": (lambda v: True, "any"),
        },
    )
    moe = MoeConfig(
        num_experts=_experts(cfg, "num_experts", "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    return _base(arch, cfg, qk_norm=True, moe=moe)


def read_mixtral(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    check_fields(
        arch,
        cfg,
        fields={"num_local_experts", "sliding_window", "router_jitter_noise"},
        rules={"hidden_act": SILU_ONLY},
    )
    moe = MoeConfig(
        num_experts=_experts(cfg, "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,  # MixtralTopKRouter always renormalises
    )
    return _base(arch, cfg, sliding_window=cfg.get("sliding_window"), moe=moe)


def read_olmoe(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    check_fields(
        arch,
        cfg,
        fields={"num_experts", "norm_topk_prob"},
        rules={"hidden_act": SILU_ONLY, "attention_bias": FALSE, "clip_qkv": NULL},
    )
    moe = MoeConfig(
        num_experts=_experts(cfg, "num_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    # q/k norms over the whole projection: models/olmoe.py, not the per-head qk_norm.
    return _base(arch, cfg, moe=moe)


def read_gpt_oss(arch: str, cfg: Mapping[str, Any]) -> ModelConfig:
    check_fields(
        arch,
        cfg,
        fields={
            "num_local_experts",
            "sliding_window",
            "layer_types",
            "swiglu_limit",
            "swiglu_alpha",
            # informational duplicates of read fields
            "experts_per_token",
            "initial_context_length",
        },
        # The experts' activation is the clamped SwiGLU whatever hidden_act says.
        rules={"attention_bias": (lambda v: v is True, "true"), "hidden_act": (lambda v: True, "")},
    )
    moe = MoeConfig(
        num_experts=_experts(cfg, "num_local_experts"),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        router=TOPK_SOFTMAX,
        router_bias=True,
        expert_bias=True,
        activation=CLAMPED_SWIGLU,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    return gpt_oss_config(arch, cfg, moe)


def gpt_oss_config(arch: str, cfg: Mapping[str, Any], moe: MoeConfig) -> ModelConfig:
    """GPT-OSS's attention: biased q/k/v/o, sinks, alternating sliding and full
    layers (``layer_types``), yarn RoPE."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    needed = {"layer_types", "attention_sinks"}
    if not needed <= fields:
        raise UnsupportedModelError(
            f"{arch}: attention sinks and per-layer windows are not in this build "
            f"(ModelConfig lacks {sorted(needed - fields)})"
        )
    layer_types = tuple(cfg.get("layer_types") or ())
    return _base(
        arch,
        cfg,
        qkv_bias=True,
        sliding_window=cfg.get("sliding_window"),
        layer_types=layer_types,
        attention_sinks=True,
        moe=moe,
    )


MOE_CONFIG_READERS: dict[str, Callable[[str, Mapping[str, Any]], ModelConfig]] = {
    "Qwen3MoeForCausalLM": read_qwen3_moe,
    "MixtralForCausalLM": read_mixtral,
    "OlmoeForCausalLM": read_olmoe,
    "GptOssForCausalLM": read_gpt_oss,
}
