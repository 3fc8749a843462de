"""Write GGUF files the way llama.cpp's converter does, for tests.

Names come from gguf-py's own HF -> GGUF table and the Q/K permutation is
spelled out here as in convert_hf_to_gguf.py, so these files test our reader
against llama.cpp's conventions rather than against our own inverse.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

GGUF_ARCH = {
    "LlamaForCausalLM": (gguf.MODEL_ARCH.LLAMA, "llama"),
    "MistralForCausalLM": (gguf.MODEL_ARCH.LLAMA, "llama"),
    "Qwen2ForCausalLM": (gguf.MODEL_ARCH.QWEN2, "qwen2"),
    "Qwen3ForCausalLM": (gguf.MODEL_ARCH.QWEN3, "qwen3"),
}

# A byte-level BPE vocabulary: the 256 byte symbols, a few merges, specials.
BYTE_SYMBOLS = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xA1, 0xAD)]
BYTE_SYMBOLS += [chr(c) for c in range(0xAE, 0x100)]
BYTE_SYMBOLS += [chr(0x100 + i) for i in range(256 - len(BYTE_SYMBOLS))]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + BYTE_SYMBOLS + ["he", "ll", "hell", "hello", "Ġw"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head already the KV
    head count for K)."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def encode(array: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    """Bytes (or a float array) for ``add_tensor`` in the requested type."""
    if qtype == QType.F32:
        return array.astype(np.float32), None
    if qtype == QType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_model_gguf(
    path: Path,
    hf_config,  # a transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor],
    *,
    types: dict[str, QType] | None = None,
    extra_tensors: dict[str, np.ndarray | tuple[np.ndarray, QType]] | None = None,
    rope_scaling: tuple[str, float, int] | None = None,
    tokenizer: bool = True,
    metadata: dict[str, float | int] | None = None,
) -> None:
    """``types`` maps GGUF tensor-name substrings (e.g. "attn_q") to a type;
    everything else is F32. ``extra_tensors`` are written as given (raw bytes
    with their type, or float arrays). ``metadata``: more keys (int32 or
    float32, as llama.cpp writes general.sampling.*)."""
    architecture = hf_config.architectures[0]
    arch, arch_name = GGUF_ARCH[architecture]
    names = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_rope_freq_base(hf_config.rope_parameters["rope_theta"])
    if getattr(hf_config, "head_dim", None):
        writer.add_key_length(hf_config.head_dim)
        writer.add_value_length(hf_config.head_dim)
    writer.add_vocab_size(hf_config.vocab_size)
    if rope_scaling is not None:
        kind, factor, original = rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original)
    if tokenizer:
        add_tokenizer(writer)
    for key, value in (metadata or {}).items():
        if isinstance(value, int):
            writer.add_int32(key, value)
        else:
            writer.add_float32(key, value)

    for hf_name, tensor in state_dict.items():
        if hf_config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        array = tensor.float().numpy()
        if arch_name == "llama" and "q_proj" in hf_name:
            array = llama_cpp_permute(array, heads)
        elif arch_name == "llama" and "k_proj" in hf_name:
            array = llama_cpp_permute(array, kv_heads)
        qtype = next((t for key, t in (types or {}).items() if key in name), QType.F32)
        data, raw = encode(array, qtype if array.ndim == 2 else QType.F32)
        writer.add_tensor(name, data, raw_dtype=raw)
    for name, extra in (extra_tensors or {}).items():
        data, raw = extra if isinstance(extra, tuple) else (extra, None)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    types = [gguf.TokenType.CONTROL] * len(SPECIALS)
    types += [gguf.TokenType.NORMAL] * (len(TOKENS) - len(SPECIALS))
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tensors_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QType | None]]) -> None:
    """A GGUF of bare tensors (no model metadata), for codec checks."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FAMILY_GGUF_ARCH = {
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
}


def write_family_gguf(
    path: Path,
    hf_config,
    state_dict: dict[str, torch.Tensor],
    *,
    extra: dict[str, float | bool] | None = None,
) -> None:
    """A Gemma 2, Gemma 3 or Phi-3 checkpoint written as convert_hf_to_gguf.py
    writes it (Gemma2Model, Gemma3Model, Phi3MiniModel): their metadata keys,
    Gemma's norms stored as 1 + w and its LM head dropped (tied), Phi-3's
    fused tensors under gguf-py's names and its longrope factors as tensors.
    No Q/K permutation: llama.cpp runs these with the neox RoPE kernel.
    ``extra``: more metadata keys (float32 or bool)."""
    arch = FAMILY_GGUF_ARCH[hf_config.architectures[0]]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    cfg = hf_config
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tensors = {name: t.float().numpy() for name, t in state_dict.items()}
    rope = cfg.rope_parameters
    if arch_name == "gemma2":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif arch_name == "gemma3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        full = rope.get("full_attention", rope)
        writer.add_rope_freq_base(full["rope_theta"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    else:
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = cfg.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            writer.add_tensor(
                "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
            )
            writer.add_tensor(
                "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
            )
    add_extra(writer, extra)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    gemma = arch_name.startswith("gemma")
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight" and (gemma or cfg.tie_word_embeddings):
            continue
        if gemma and hf_name.endswith("norm.weight"):
            array = array + 1
        base, suffix = hf_name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_moe_gguf(
    path: Path,
    hf_config,
    state_dict: dict[str, torch.Tensor],
    *,
    extra: dict[str, float | bool] | None = None,
) -> None:
    """A Qwen3-MoE or Mixtral checkpoint written as convert_hf_to_gguf.py
    writes it: Qwen3-MoE as ``qwen3moe``, Mixtral as ``llama`` (Q/K rows
    permuted) with ``expert_count``; the router as ``ffn_gate_inp`` and each
    layer's experts stacked per part (``ffn_{gate,up,down}_exps``, dim 0 the
    experts, each expert in HF's [out, in]). ``extra``: more metadata keys
    (float32 or bool)."""
    qwen = hf_config.architectures[0] == "Qwen3MoeForCausalLM"
    arch = gguf.MODEL_ARCH.QWEN3MOE if qwen else gguf.MODEL_ARCH.LLAMA
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    cfg = hf_config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_expert_count(cfg.num_experts if qwen else cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if qwen:
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_extra(writer, extra)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)

    def block(tensor: gguf.MODEL_TENSOR, layer: str) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=layer) + ".weight"

    for hf_name, tensor in state_dict.items():
        array = tensor.float().numpy()
        parts = hf_name.split(".")
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if parts[-2:] == ["experts", "gate_up_proj"]:
            gate, up = np.split(array, 2, axis=1)
            writer.add_tensor(block(gguf.MODEL_TENSOR.FFN_GATE_EXP, parts[2]), gate.copy())
            writer.add_tensor(block(gguf.MODEL_TENSOR.FFN_UP_EXP, parts[2]), up.copy())
            continue
        if parts[-2:] == ["experts", "down_proj"]:
            writer.add_tensor(block(gguf.MODEL_TENSOR.FFN_DOWN_EXP, parts[2]), array)
            continue
        if parts[-3:] == ["mlp", "gate", "weight"]:
            writer.add_tensor(block(gguf.MODEL_TENSOR.FFN_GATE_INP, parts[2]), array)
            continue
        if not qwen and "q_proj" in hf_name:
            array = llama_cpp_permute(array, heads)
        elif not qwen and "k_proj" in hf_name:
            array = llama_cpp_permute(array, kv_heads)
        base, suffix = hf_name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_extra(writer: gguf.GGUFWriter, extra: dict[str, float | bool] | None) -> None:
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_float32(key, value)
