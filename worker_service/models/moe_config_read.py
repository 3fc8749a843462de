"""What the mixture-of-experts families' config readers share: the attention
and embedding part read as the Llama family reads it, the expert count under
its several names, and the fields every MoE config carries that do not
change inference. Each family's own reader (its module) names the fields it
implements and refuses the rest (models/config_fields.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.config_fields import SHAPE_FIELDS
from worker_service.models.family import FamilySupport

# Read by ModelConfig.from_hf for every family here.
SHARED_FIELDS = frozenset(
    {
        *SHAPE_FIELDS,
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "num_experts_per_tok",
    }
)

MOE_SUPPORT = FamilySupport(
    tensor_parallel=True,
    lora=True,
    speculative=True,
    grammar=True,
    gguf=False,
    lora_note="attention projections (q, k, v, o) only: the experts are no LoRA target",
)
# Qwen3-MoE and Mixtral: also from llama.cpp's GGUF files (weights/gguf_families.py).
MOE_GGUF_SUPPORT = dataclasses.replace(MOE_SUPPORT, gguf=True)


def llama_part(arch: str, cfg: Mapping[str, Any], **changes: Any) -> ModelConfig:
    """The attention/embedding part, read as the Llama family reads it
    (``sliding_window`` and ``attention_bias`` are each family's to set)."""
    llama = {k: v for k, v in cfg.items() if k not in ("sliding_window", "attention_bias")}
    base = ModelConfig.from_hf({**llama, "architectures": ["LlamaForCausalLM"]})
    return dataclasses.replace(base, architecture=arch, **changes)


def expert_count(cfg: Mapping[str, Any], *names: str) -> int:
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    raise UnsupportedModelError(f"config.json lacks the number of experts ({' or '.join(names)})")
