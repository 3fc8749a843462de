"""Model classes by the ``architectures`` name in the model's config."""

from __future__ import annotations

import torch

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import Kernels
from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.mixtral import MixtralForCausalLM
from worker_service.models.olmoe import OlmoeForCausalLM
from worker_service.models.qwen3_moe import Qwen3MoeForCausalLM
from worker_service.models.score_head import SEQUENCE_CLASSIFIERS

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # The same class with a score head instead of the LM head (config.score_head).
    **dict.fromkeys(SEQUENCE_CLASSIFIERS, LlamaForCausalLM),
}


def build_model(
    config: ModelConfig,
    *,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    kernels: Kernels | None = None,
) -> LlamaForCausalLM:
    """``kernels``: None picks them for the device and dtype (select_kernels)."""
    cls = MODELS.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class for {config.architecture}")
    return cls(config, tp=tp, dtype=dtype, device=device, kernels=kernels)
