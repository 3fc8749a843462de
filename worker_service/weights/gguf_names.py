"""GGUF tensor names and layouts -> Hugging Face names and layouts.

llama.cpp renames every tensor (``blk.3.attn_q.weight`` for
``model.layers.3.self_attn.q_proj.weight``), stores shapes innermost first
(ggml order), and, for the ``llama`` architecture only, reorders the rows of
the Q and K projections to suit its rotary kernel. This module undoes all
three, so a GGUF file yields exactly the tensors of the HF checkpoint it was
converted from (up to quantization).
"""

from __future__ import annotations

import re

import numpy as np

# Tensors outside the decoder blocks.
GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tensors inside block N: ``blk.N.<key>`` -> ``model.layers.N.<value>``.
BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}

# A MoE layer's experts, stacked (dim 0: experts, each in HF's [out, in]):
# read as the checkpoint's per-expert tensors ``mlp.experts.{e}.<part>``.
EXPERT_NAMES: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}

# Where an architecture's blocks differ from BLOCK_NAMES. llama.cpp reuses
# ``ffn_norm`` for Gemma's pre-feed-forward norm (its post-attention norm is
# ``post_attention_norm``), and Phi-3's checkpoints keep q/k/v and gate/up
# fused (``attn_qkv``, ``ffn_up`` holding gate then up).
_GEMMA_BLOCKS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_BLOCKS,
    "gemma3": _GEMMA_BLOCKS,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}

# llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm
# multiplies by the stored weight); HF's checkpoint holds w.
NORM_SHIFTED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})

# Not a weight: llama.cpp's per-frequency RoPE divisors (Llama 3.1 scaling).
ROPE_FREQS = "rope_freqs.weight"
# Nor these: Phi-3's longrope factors (weights/gguf_families.py reads them).
ROPE_TENSORS = frozenset({ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"})

# llama.cpp picks the rotary kernel by architecture: "normal" RoPE (rotating
# adjacent pairs x[2i], x[2i+1]) for llama, "neox" RoPE (rotating x[i] with
# x[i + d/2], what HF's rotate_half does) for qwen2/qwen3. Its converter
# permutes Q/K rows only for the architectures that use the normal kernel.
PERMUTED_ARCHITECTURES = frozenset({"llama"})

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of llama.cpp architecture
    ``arch``, or None when it has no counterpart."""
    if match := _BLOCK_RE.fullmatch(gguf_name):
        layer, key, kind = match.groups()
        if key in EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{EXPERT_NAMES[key]}.{kind}"
        target = {**BLOCK_NAMES, **ARCH_BLOCK_NAMES.get(arch, {})}.get(key)
        return None if target is None else f"model.layers.{layer}.{target}.{kind}"
    if match := _GLOBAL_RE.fullmatch(gguf_name):
        key, kind = match.groups()
        target = GLOBAL_NAMES.get(key)
        return None if target is None else f"{target}.{kind}"
    return None


def per_expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The per-expert HF names a stacked expert tensor splits into (dim 0),
    or None when it is no stacked expert tensor."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in EXPERT_NAMES:
        return None
    layer, key, kind = match.groups()
    part = EXPERT_NAMES[key]
    return [f"model.layers.{layer}.mlp.experts.{e}.{part}.{kind}" for e in range(num_experts)]


def is_shifted_norm(gguf_name: str, arch: str) -> bool:
    """Whether the file holds this tensor as 1 + w (undone by the reader)."""
    return arch in NORM_SHIFTED_ARCHITECTURES and gguf_name.endswith("norm.weight")


def rotary_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads a permuted tensor's rows split into (Q: query heads,
    K: KV heads), or None when the tensor was not permuted."""
    key = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if key == "attn_q":
        return num_heads
    if key == "attn_k":
        return num_kv_heads
    return None


def unpermute_rotary_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (weights [out, in] or biases [out]).

    Within each head of ``d = head_dim`` rows, HF keeps the two rotary halves
    apart and llama.cpp interleaves them, pairing row i with row i + d/2::

        HF (rotate_half):  h0 h1 ... h(d/2-1) | g0 g1 ... g(d/2-1)
        llama.cpp:         h0 g0 h1 g1 ... h(d/2-1) g(d/2-1)

    The converter did ``reshape(heads, 2, d/2, ...).swapaxes(1, 2)``; viewing
    the rows as (heads, d/2, 2) and swapping back restores (heads, 2, d/2).
    """
    out_rows = rows.shape[0]
    if out_rows % (2 * num_heads):
        raise ValueError(f"{out_rows} rows do not split into {num_heads} heads of rotary pairs")
    half = out_rows // num_heads // 2
    grouped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)
