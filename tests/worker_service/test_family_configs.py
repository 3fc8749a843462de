"""The Gemma and Phi-3 families' config readers: what they read from real
checkpoints' config.json (both transformers spellings), and the fields and
values they refuse by name."""

from __future__ import annotations

import math

import pytest

from worker_service.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    RopeConfig,
    UnsupportedModelError,
)
from worker_service.models.registry import config_from_hf

# google/gemma-3-1b-it's config.json (transformers 4.50 spelling).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}

# google/gemma-2-2b-it's.
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.4",
    "use_cache": True,
    "vocab_size": 256000,
}

# microsoft/Phi-3-mini-128k-instruct's, factors cut to the test's head_dim.
PHI3_128K = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": [1.0 + i for i in range(48)],
        "short_factor": [1.0 + i / 100 for i in range(48)],
        "type": "longrope",
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2",
    "use_cache": True,
    "vocab_size": 32064,
}


def test_gemma3_reads_its_layer_pattern_local_rope_and_scales():
    cfg = config_from_hf(GEMMA3_1B)
    assert cfg.layer_types[:6] == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert [cfg.window_of(i) for i in (0, 5, 11, 25)] == [512, None, None, 512]
    assert cfg.rope == RopeConfig(theta=1e6)
    assert cfg.rope_local == RopeConfig(theta=10000.0)
    assert cfg.attn_scale == 256**-0.5 and cfg.embed_scale == math.sqrt(1152)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    assert cfg.eos_token_ids == (1, 106)


def test_gemma3_transformers5_spelling_per_layer_type_rope():
    v5 = {k: v for k, v in GEMMA3_1B.items() if not k.startswith("rope")}
    v5.pop("sliding_window_pattern")
    v5["layer_types"] = [SLIDING_ATTENTION, FULL_ATTENTION] * 13
    v5["_sliding_window_pattern"] = 6  # what transformers 5 saves beside layer_types
    v5["rope_parameters"] = {
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10000.0},
        FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    cfg = config_from_hf(v5)
    assert cfg.layer_types == tuple(v5["layer_types"])  # layer_types win over the pattern
    assert cfg.rope == RopeConfig(theta=1e6, scaling_type="linear", factor=8.0)
    assert cfg.rope_local == RopeConfig(theta=10000.0)


def test_gemma2_reads_soft_caps_and_alternating_layers():
    cfg = config_from_hf(GEMMA2_2B)
    assert cfg.attn_logit_softcap == 50.0 and cfg.final_logit_softcap == 30.0
    assert cfg.layer_types[:4] == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert cfg.sliding_window == 4096 and cfg.rope_local is None and not cfg.qk_norm


def test_a_gemma3_with_every_layer_global_has_no_window():
    cfg = config_from_hf({**GEMMA3_1B, "layer_types": [FULL_ATTENTION] * 26})
    assert cfg.sliding_window is None and cfg.sliding_layers == ()


def test_phi4_mini_partial_rotary():
    cfg = config_from_hf(
        {**PHI3_128K, "partial_rotary_factor": 0.75, "hidden_size": 128 * 32,
         "rope_scaling": {**PHI3_128K["rope_scaling"], "short_factor": [1.0] * 48,
                          "long_factor": [2.0] * 48}}
    )  # fmt: skip
    assert cfg.head_dim == 128 and cfg.rope.partial_rotary_factor == 0.75


def test_phi3_reads_longrope_with_its_factor_from_the_context_lengths():
    cfg = config_from_hf({**PHI3_128K, "hidden_size": 96 * 32})
    rope = cfg.rope
    assert rope.scaling_type == "longrope" and rope.original_max_position_embeddings == 4096
    assert rope.factor == 131072 / 4096 and rope.short_factor[1] == 1.01
    assert cfg.sliding_window == 262144 and cfg.head_dim == 96


@pytest.mark.parametrize(
    ("config", "change", "named"),
    [
        (GEMMA3_1B, {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        (GEMMA3_1B, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        (GEMMA3_1B, {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (GEMMA3_1B, {"altup_num_inputs": 4}, "altup_num_inputs"),
        (GEMMA3_1B, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        (GEMMA2_2B, {"hidden_act": "silu"}, "hidden_act='silu'"),
        (PHI3_128K, {"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
        (PHI3_128K, {"partial_rotary_factor": 0.75}, "48 factors, 72 rotary dims need 36"),
        (
            GEMMA3_1B,
            {"rope_scaling": {"rope_type": "linear", "factor": 8.0, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor is not supported",
        ),
        (PHI3_128K, {"attention_bias": True}, "attention_bias=True"),
        (PHI3_128K, {"lm_head_bias": True}, "lm_head_bias"),
        (
            PHI3_128K,
            {"rope_scaling": {**PHI3_128K["rope_scaling"], "mscale": 1.2}},
            "fields not implemented: mscale",
        ),
        (
            PHI3_128K,
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}},
            "needs short_factor and long_factor",
        ),
        (PHI3_128K, {"hidden_size": 64 * 32}, "48 factors, 64 rotary dims need 32"),
    ],
)
def test_refused_by_name(config, change, named):
    with pytest.raises(UnsupportedModelError, match=named.replace("(", r"\(").replace(".", r"\.")):
        config_from_hf({**config, **change})


def test_multimodal_gemma3_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="Gemma3ForConditionalGeneration: Gemma 3 with"):
        config_from_hf(
            {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
        )


def test_qwen2_slides_only_the_layers_transformers_slides():
    # transformers: with use_sliding_window, Qwen2/3 slide the layers from
    # max_window_layers on (or those config.json's layer_types names).
    from transformers import Qwen2Config

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    hf = Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    raw = {"architectures": ["Qwen2ForCausalLM"], **shape, "use_sliding_window": True}
    old_style = config_from_hf({**raw, "sliding_window": 8, "max_window_layers": 2})
    assert old_style.layer_types == tuple(hf.layer_types)
    assert [old_style.window_of(i) for i in range(4)] == [None, None, 8, 8]
    declared = config_from_hf({**raw, "sliding_window": 8, "layer_types": hf.layer_types})
    assert declared.layer_types == tuple(hf.layer_types)
    # Every layer below max_window_layers: nothing slides.
    none = config_from_hf({**raw, "sliding_window": 8, "max_window_layers": 4})
    assert none.sliding_window is None and none.layer_types == ()
