"""The model side of LoRA: for each projection an adapter may target, its
shape in the whole model and the shard this tensor-parallel rank holds.
models/lora_loader.py reads them off the model's own layers, so adapter shards
line up with the base weights' shards by construction (this module imports no
model: the model's layers import the adapters)."""

from __future__ import annotations

from dataclasses import dataclass

# projection -> (the block it sits in, the fused module holding it)
PLACES = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


@dataclass(frozen=True)
class ProjectionShape:
    name: str  # q_proj ... down_proj
    block: str  # self_attn | mlp
    fused: str  # the model module: qkv_proj, o_proj, gate_up_proj, down_proj
    column: bool  # column parallel (output sharded) or row parallel (input sharded)
    in_features: int  # whole model
    out_features: int  # whole model
    # column: [lo, hi) of the output features this rank holds, and where that
    # shard starts in the fused module's output; row: [lo, hi) of the input.
    lo: int
    hi: int
    fused_start: int = 0


@dataclass(frozen=True)
class LoraTargets:
    num_layers: int
    projections: dict[str, ProjectionShape]
    # The fused column modules' local output widths (qkv_proj -> q + k + v shard).
    fused_widths: dict[str, int]

    def module_paths(self) -> dict[str, str]:
        """Every targetable module by its Hugging Face path (what PEFT's
        target_modules are matched against) -> projection name."""
        return {
            f"model.layers.{i}.{p.block}.{p.name}": p.name
            for i in range(self.num_layers)
            for p in self.projections.values()
        }
