"""FP8 quantization written from the formats' definitions, apart from
worker_service's code, and torch only (the GPU image runs what imports it):
scale = amax / 448 over the scale's group (a tensor, an output channel, a
128x128 block), weight = fp8 * scale. ``write_random_fp8_llama`` writes a
tiny Llama checkpoint of random FP8 projections without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale) with weight ~= fp8 * scale."""
    w = w.float()
    out, inp = w.shape
    if granularity == "tensor":
        scale = w.abs().max() / 448.0
        return (w / scale).to(FP8), scale.reshape(())
    if granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / scale).to(FP8), scale
    rows, cols = -(-out // 128), -(-inp // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out, :inp] = w
    blocks = padded.view(rows, 128, cols, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).view(rows * 128, cols * 128)[:out, :inp]
    return q.to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity != "block":
        return q.float() * scale
    out, inp = q.shape
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    return q.float() * full


RANDOM_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
}
QUANTIZATION = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


def write_random_fp8_llama(path: Path, granularity: str) -> None:
    """A 2-layer Llama with random FP8 projections (``granularity`` scales;
    per-tensor ones with static input scales) and float embeddings, norms
    and LM head."""
    cfg = RANDOM_LLAMA
    g = torch.Generator().manual_seed(3)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * 64, cfg["num_key_value_heads"] * 64
    shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    tensors = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g),
        "model.norm.weight": torch.ones(h),
        # Logits of std ~0.8: FP8 activations (~2% per matmul) move them by little.
        "lm_head.weight": torch.randn(v, h, generator=g) * 0.05,
    }
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        tensors[f"{pre}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{pre}.post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
            w *= torch.linspace(0.3, 1.5, shape[0])[:, None]
            fp8, scale = quantize(w, granularity)
            tensors[f"{pre}.{name}.weight"] = fp8
            scale_name = "weight_scale_inv" if granularity == "block" else "weight_scale"
            tensors[f"{pre}.{name}.{scale_name}"] = scale
            if granularity == "tensor":
                tensors[f"{pre}.{name}.input_scale"] = torch.tensor(8.0 / 448.0)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = cfg | {"quantization_config": QUANTIZATION[granularity]}
    (path / "config.json").write_text(json.dumps(config))
