"""LoadAdapter on a worker with a real model: this rank's shard of an
adapter's weights, shaped by the model's own layers (lora_targets), so the
adapter's shards line up with the base weights' shards by construction. It
lives with the model because it reads the model's layers; lora/ imports no
model (the model's layers apply the adapters)."""

from __future__ import annotations

from pathlib import Path

import torch

from worker_service.lora.adapter import load_lora_adapter
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
        module = getattr(getattr(layer, block), fused, None)
        if module is None:
            continue  # a mixture-of-experts MLP: its experts are no LoRA target
        if isinstance(module, FusedColumnLinear):
            start, local, full = module.offsets[name]
            lo = module.tp.rank * local
            in_features = module.weight.shape[1]
            projections[name] = ProjectionShape(
                name=name,
                block=block,
                fused=fused,
                column=True,
                in_features=in_features,
                out_features=full,
                lo=lo,
                hi=lo + local,
                fused_start=start,
            )
            widths[fused] = module.weight.shape[0]
        else:
            assert isinstance(module, RowLinear)
            in_features = (module.hi - module.lo) * module.tp.size
            out_features = module.weight.shape[0]
            projections[name] = ProjectionShape(
                name=name,
                block=block,
                fused=fused,
                column=False,
                in_features=in_features,
                out_features=out_features,
                lo=module.lo,
                hi=module.hi,
            )
    return LoraTargets(len(model.layers), projections, widths)


class ModelAdapterLoader:
    """Loads this rank's shard of an adapter for ``model`` (on a gRPC thread:
    the host reads and slices; the copy to the device waits for nothing but
    the kernels queued before it)."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device) -> None:
        self.targets: LoraTargets = lora_targets(model)
        self.dtype = model.dtype
        self.device = device

    def load(self, name: str, path: Path, max_rank: int) -> LoadedAdapter:
        return load_lora_adapter(
            name, path, self.targets, dtype=self.dtype, device=self.device, max_rank=max_rank
        )
