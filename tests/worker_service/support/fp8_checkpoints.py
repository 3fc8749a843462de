"""Tiny FP8 checkpoints written the way published ones are: a random
transformers model (float32), each decoder projection quantized to E4M3 with
its scales (per tensor, per output channel, or per 128x128 block), saved as
safetensors beside a config.json carrying the scheme's quantization_config.

The quantization is support/fp8_quant.py's (the formats' definitions,
apart from worker_service's code). ``dequantized_reference`` is transformers' float model holding
exactly those dequantized weights.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3Config

from tests.worker_service.support.fp8_quant import dequantize, quantize

VOCAB = 256
# Dims over several 128-blocks, with non-square block grids (gate/up 3x2,
# down 2x3), so a transposed block scale is a wrong shape or wrong values.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Form:
    """One checkpoint format: its quantization_config and tensor naming."""

    granularity: str  # "tensor" | "channel" | "block"
    quantization_config: dict[str, Any]
    scale_name: str  # "weight_scale" or "weight_scale_inv"
    static: bool = False  # writes input_scale per projection


def compressed_tensors(strategy: str, *, static: bool) -> dict[str, Any]:
    acts = {"num_bits": 8, "type": "float", "symmetric": True}
    acts |= (
        {"strategy": "tensor", "dynamic": False}
        if static
        else {"strategy": "token", "dynamic": True}
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": strategy,
                    "dynamic": False,
                },
                "input_activations": acts,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


FORMS = {
    # transformers' FineGrainedFP8 / DeepSeek's: 128x128 blocks, dynamic.
    "fp8-block": Fp8Form(
        "block",
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "weight_scale_inv",
    ),
    # FineGrainedFP8 per tensor (weight_block_size null), transformers' naming.
    "fp8-tensor": Fp8Form(
        "tensor",
        {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "dynamic"},
        "weight_scale_inv",
    ),
    # AutoFP8 / vLLM: per tensor, static input_scale, weight_scale naming.
    "fp8-tensor-static": Fp8Form(
        "tensor", {"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale", True
    ),
    "fbgemm-channel": Fp8Form(
        "channel",
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
        "weight_scale",
    ),
    "ct-channel": Fp8Form("channel", compressed_tensors("channel", static=False), "weight_scale"),
    "ct-tensor-static": Fp8Form(
        "tensor", compressed_tensors("tensor", static=True), "weight_scale", True
    ),
}


def hf_model(arch: str, seed_name: str, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(zlib.crc32(seed_name.encode()))
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    cfg = cls(**(SHAPE | overrides))
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # greedy ties are fragile on a flat head
        for name, p in model.named_parameters():
            # Rows of very different magnitudes, so per-channel scales differ
            # from per-tensor ones and a scale applied to the wrong rows shows.
            if name.endswith("_proj.weight"):
                p.mul_(torch.linspace(0.2, 3.0, p.shape[0])[:, None])
    return model


def write_fp8_checkpoint(
    path: Path, form_name: str, *, arch: str = "llama", **overrides: Any
) -> PreTrainedModel:
    """Writes the FP8 checkpoint of a tiny ``arch`` model in ``path``; returns
    transformers' float model holding exactly the dequantized weights."""
    form = FORMS[form_name]
    model = hf_model(arch, form_name + arch, **overrides)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            module = name.rsplit(".", 2)
            if name.endswith(".weight") and module[-2] in PROJECTIONS:
                q, scale = quantize(p, form.granularity)
                base = name.removesuffix(".weight")
                tensors[name] = q
                tensors[f"{base}.{form.scale_name}"] = scale
                if form.static:
                    tensors[f"{base}.input_scale"] = torch.tensor(0.02 + 0.001 * len(tensors))
                p.copy_(dequantize(q, scale, form.granularity))
            else:
                tensors[name] = p.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": form.quantization_config}
    (path / "config.json").write_text(json.dumps(config))
    return model


def rewrite(path: Path, change) -> None:
    """Rewrites the checkpoint's tensors through ``change(dict)`` (a broken copy)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))
