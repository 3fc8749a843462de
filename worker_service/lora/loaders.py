"""What LoadAdapter does on each kind of worker: the real model reads and
shards the weights (models/lora_loader.py, which knows the model's layers);
the simulated model (--model simulated), which has no weights, reads
adapter_config.json only (here), so a scheduler's LoRA paths (ranks, limits,
errors) run against it unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from worker_service.lora.peft_config import (
    FUSED_MODULES,
    LORA_MODULES,
    read_lora_config,
    resolve_targets,
)
from worker_service.lora.store import LoadedAdapter


class AdapterLoader(Protocol):
    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        """Read the adapter in ``path``; AdapterError says why it cannot be served."""
        ...


@dataclass(frozen=True)
class AdapterInfo:
    """A simulated worker's adapter: what its config says, no weights."""

    name: str
    rank: int
    target_modules: tuple[str, ...]


# A one-layer Llama's module paths, and its fused ones (Phi-3's checkpoint
# names), for resolving target_modules without a model.
_GENERIC_PATHS = {
    f"model.layers.0.{'self_attn' if m in (*LORA_MODULES[:4], 'qkv_proj') else 'mlp'}.{m}": m
    for m in (*LORA_MODULES, *FUSED_MODULES)
}


class ConfigOnlyLoader:
    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        config = read_lora_config(path, max_rank)
        chosen = {_GENERIC_PATHS[p] for p in resolve_targets(config, _GENERIC_PATHS)}
        chosen |= {part for fused in chosen & set(FUSED_MODULES) for part in FUSED_MODULES[fused]}
        modules = tuple(m for m in LORA_MODULES if m in chosen)
        return AdapterInfo(name, config.rank, modules)
