"""What LoadAdapter does on each kind of worker: the real model reads and
shards the weights (adapter.py); the simulated model (--model simulated),
which has no weights, reads adapter_config.json only, so a scheduler's LoRA
paths (ranks, limits, errors) run against it unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from worker_service.lora.adapter import load_lora_adapter
from worker_service.lora.peft_config import LORA_MODULES, read_lora_config, resolve_targets
from worker_service.lora.store import LoadedAdapter
from worker_service.lora.targets import PLACES, LoraTargets, ProjectionShape
from worker_service.models.layers import FusedColumnLinear, RowLinear
from worker_service.models.llama import LlamaForCausalLM


def lora_targets(model: LlamaForCausalLM) -> LoraTargets:
    if not model.layers:
        return LoraTargets(0, {}, {})
    layer = model.layers[0]
    projections: dict[str, ProjectionShape] = {}
    widths: dict[str, int] = {}
    for name, (block, fused) in PLACES.items():
        module = getattr(getattr(layer, block), fused)
        if isinstance(module, FusedColumnLinear):
            start, local, full = module.offsets[name]
            lo = module.tp.rank * local
            in_features = module.weight.shape[1]
            projections[name] = ProjectionShape(
                name, block, fused, True, in_features, full, lo, lo + local, start
            )
            widths[fused] = module.weight.shape[0]
        else:
            assert isinstance(module, RowLinear)
            in_features = (module.hi - module.lo) * module.tp.size
            out_features = module.weight.shape[0]
            projections[name] = ProjectionShape(
                name, block, fused, False, in_features, out_features, module.lo, module.hi
            )
    return LoraTargets(len(model.layers), projections, widths)


class AdapterLoader(Protocol):
    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        """Read the adapter in ``path``; AdapterError says why it cannot be served."""
        ...


class ModelAdapterLoader:
    """Loads this rank's shard of an adapter for ``model`` (on a gRPC thread:
    the host reads and slices; the copy to the device waits for nothing but
    the kernels queued before it)."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device) -> None:
        self.targets: LoraTargets = lora_targets(model)
        self.dtype = model.dtype
        self.device = device

    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        return load_lora_adapter(name, path, self.targets, self.dtype, self.device, max_rank)


@dataclass(frozen=True)
class AdapterInfo:
    """A simulated worker's adapter: what its config says, no weights."""

    name: str
    rank: int
    target_modules: tuple[str, ...]


# A one-layer Llama's module paths, for resolving target_modules without a model.
_GENERIC_PATHS = {
    f"model.layers.0.{'self_attn' if m in LORA_MODULES[:4] else 'mlp'}.{m}": m for m in LORA_MODULES
}


class ConfigOnlyLoader:
    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        config = read_lora_config(path, max_rank)
        chosen = {_GENERIC_PATHS[p] for p in resolve_targets(config, _GENERIC_PATHS)}
        modules = tuple(m for m in LORA_MODULES if m in chosen)
        return AdapterInfo(name, config.rank, modules)
