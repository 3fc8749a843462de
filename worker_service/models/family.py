"""A model family: the architectures it serves, how it reads config.json, its
model class, and what of the serving features it supports.

Adding a family (docs/design.md, "Adding a model family") means one module
under models/ with the model class (a ``LlamaForCausalLM`` subclass that
overrides the hooks it needs) and a ``FAMILY``, listed in models/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker_service.models.config import ModelConfig


@dataclass(frozen=True)
class FamilySupport:
    """Which serving features the family's models run with (README's table).
    A feature a family lacks is refused at start, by name, never run."""

    tensor_parallel: bool = True
    lora: bool = True
    speculative: bool = True
    grammar: bool = True
    gguf: bool = False
    # What LoRA may target where the family limits it (empty: every target).
    lora_note: str = ""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    # (config, *, tp, dtype, device, kernels) -> the model module
    model_class: Callable[..., Any]
    # (architecture, config.json) -> ModelConfig; raises UnsupportedModelError
    # naming every field it does not implement.
    read_config: Callable[[str, dict[str, Any]], ModelConfig]
    support: FamilySupport = FamilySupport()
