"""The model families the worker serves, and the two lookups by the
``architectures`` name in a model's config: its config reader and its class."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import Kernels
from worker_service.models import llama
from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY,)

FAMILY_OF: dict[str, ModelFamily] = {
    arch: family for family in FAMILIES for arch in family.architectures
}


def family_of(architecture: str) -> ModelFamily:
    family = FAMILY_OF.get(architecture)
    if family is None:
        raise UnsupportedModelError(
            f"architecture {architecture} is not supported; radixserve serves {sorted(FAMILY_OF)}"
        )
    return family


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The config of a Hugging Face ``config.json``, read by its family (the
    first of its ``architectures`` that one serves)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in FAMILY_OF), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architectures {archs} are not supported; radixserve serves {sorted(FAMILY_OF)}"
        )
    return FAMILY_OF[arch].read_config(arch, cfg)


def build_model(
    config: ModelConfig,
    *,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    kernels: Kernels | None = None,
) -> nn.Module:
    """``kernels``: None picks them for the device and dtype (select_kernels)."""
    cls = family_of(config.architecture).model_class
    return cls(config, tp=tp, dtype=dtype, device=device, kernels=kernels)
