"""Why llama files are un-permuted: llama.cpp's rotary kernel for ``llama``
rotates adjacent pairs, HF's rotate_half rotates the two halves of a head.
The converter's row permutation makes the two agree; undoing it must give
back HF-layout rows whose rotate_half RoPE equals llama.cpp's result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.worker_service.weights.support.gguf_build import llama_cpp_permute
from worker_service.weights.gguf_names import hf_name, per_expert_names, unpermute_rotary_rows

HEADS, HEAD_DIM, HIDDEN, POSITIONS = 3, 8, 16, 5


def angles() -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    return torch.arange(POSITIONS).float()[:, None] * inv_freq[None, :]  # [T, d/2]


def rope_rotate_half(q: torch.Tensor) -> torch.Tensor:
    """HF: element i pairs with i + d/2."""
    theta = torch.cat([angles(), angles()], dim=-1)[:, None, :]
    first, second = q[..., : HEAD_DIM // 2], q[..., HEAD_DIM // 2 :]
    return q * theta.cos() + torch.cat([-second, first], dim=-1) * theta.sin()


def rope_adjacent_pairs(q: torch.Tensor) -> torch.Tensor:
    """llama.cpp's normal RoPE: element 2i pairs with 2i + 1."""
    theta = angles()[:, None, :]
    even, odd = q[..., 0::2], q[..., 1::2]
    out = torch.empty_like(q)
    out[..., 0::2] = even * theta.cos() - odd * theta.sin()
    out[..., 1::2] = even * theta.sin() + odd * theta.cos()
    return out


def test_unpermuted_rows_rotate_like_llama_cpp() -> None:
    torch.manual_seed(0)
    w_hf = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    x = torch.randn(POSITIONS, HIDDEN, dtype=torch.float64)
    w_file = torch.from_numpy(llama_cpp_permute(w_hf.numpy(), HEADS))

    ours = torch.from_numpy(unpermute_rotary_rows(w_file.numpy(), HEADS))
    assert torch.equal(ours, w_hf)

    hf_q = rope_rotate_half((x @ ours.T).view(POSITIONS, HEADS, HEAD_DIM))
    cpp_q = rope_adjacent_pairs((x @ w_file.T).view(POSITIONS, HEADS, HEAD_DIM))
    # The same vectors up to the order of their coordinates: llama.cpp's
    # output is in the permuted order, so un-permute it to compare.
    cpp_rows = unpermute_rotary_rows(cpp_q.reshape(POSITIONS, -1).T.numpy(), HEADS)
    assert torch.allclose(hf_q.reshape(POSITIONS, -1), torch.from_numpy(cpp_rows).T)
    # And dot products (attention scores) agree without any reordering.
    scores_hf = torch.einsum("thd,shd->hts", hf_q, hf_q)
    scores_cpp = torch.einsum("thd,shd->hts", cpp_q, cpp_q)
    assert torch.allclose(scores_hf, scores_cpp)


def test_bias_rows_unpermute_too() -> None:
    bias = np.arange(HEADS * HEAD_DIM, dtype=np.float32)
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(bias, HEADS), HEADS), bias)


def test_rows_must_split_into_heads() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_rotary_rows(np.zeros((10, 4)), 3)


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_k.bias", "model.layers.12.self_attn.k_proj.bias"),
        ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("rope_freqs.weight", None),
        ("blk.0.ffn_gate_shexp.weight", None),  # shared experts: not read
        ("blk.x.attn_q.weight", None),
    ],
)
def test_names(gguf: str, hf: str | None) -> None:
    assert hf_name(gguf) == hf


@pytest.mark.parametrize(
    ("arch", "gguf", "hf"),
    [
        ("gemma2", "blk.3.ffn_norm.weight", "model.layers.3.pre_feedforward_layernorm.weight"),
        (
            "gemma3",
            "blk.3.post_ffw_norm.weight",
            "model.layers.3.post_feedforward_layernorm.weight",
        ),
        ("phi3", "blk.1.attn_qkv.weight", "model.layers.1.self_attn.qkv_proj.weight"),
        ("phi3", "blk.1.ffn_up.weight", "model.layers.1.mlp.gate_up_proj.weight"),
        ("llama", "blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("qwen3moe", "blk.2.ffn_gate_inp.weight", "model.layers.2.mlp.gate.weight"),
    ],
)
def test_names_per_architecture(arch: str, gguf: str, hf: str) -> None:
    assert hf_name(gguf, arch) == hf


def test_stacked_experts_split_into_the_checkpoints_per_expert_names() -> None:
    assert per_expert_names("blk.2.ffn_down_exps.weight", 2) == [
        "model.layers.2.mlp.experts.0.down_proj.weight",
        "model.layers.2.mlp.experts.1.down_proj.weight",
    ]
    assert per_expert_names("blk.2.ffn_down.weight", 2) is None
