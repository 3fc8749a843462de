"""A LoRA adapter in the worker's memory: per layer and per model module, the
A and B matrices of this tensor-parallel rank, in the model's dtype, ready to
apply (see batch.py), and the loader that reads them from a PEFT directory.

Sharding follows the base layers (models/layers.py), so a rank needs no
communication beyond the base model's own:

- column parallel (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``): the
  rank computes its shard of the output features, so it keeps B's rows of
  that shard and all of A (its input is whole);
- row parallel (o_proj, down_proj): the rank sees its shard of the input
  features, so it keeps A's columns of that shard and all of B. Its delta
  x_shard A_shard^T B^T is a partial sum like the base output's, added
  before RowLinear's all-reduce, which then sums the deltas exactly.

An adapter on a checkpoint's fused module (Phi-3's qkv_proj, gate_up_proj;
peft_config.FUSED_MODULES) is read as one per part, each with the fused A
and its rows of B, before any of the above.

The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B at
load; weights are never merged into the base model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from worker_service.lora.peft_config import (
    FUSED_MODULES,
    LORA_MODULES,
    WEIGHTS_FILE,
    AdapterError,
    read_lora_config,
    resolve_targets,
)
from worker_service.lora.targets import LoraTargets, ProjectionShape

# PEFT's names for the LoRA matrices of a decoder projection (the adapter
# name is stripped when PEFT saves).
_KEY = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight"
)


@dataclass(frozen=True)
class ColumnLora:
    """The deltas of one fused column-parallel module (qkv_proj, gate_up_proj):
    out[:, lo:hi] += (x a^T) b^T. The A matrices of the targeted parts are
    stacked (one matmul shrinks to every part's rank space) and b is block
    structured: the rows of a part see only that part's rank columns, and a
    part between targeted ones that is not targeted has zero rows."""

    a: torch.Tensor  # (parts * r, in_features)
    b: torch.Tensor  # (hi - lo, parts * r), scale folded in
    lo: int  # span of the fused module's local output the deltas cover
    hi: int


@dataclass(frozen=True)
class RowLora:
    """A row-parallel module's delta: out += (x_shard a^T) b^T, before the all-reduce."""

    a: torch.Tensor  # (r, local in_features)
    b: torch.Tensor  # (out_features, r), scale folded in


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]  # projection names, in the model's order
    # per layer: model module (qkv_proj, o_proj, gate_up_proj, down_proj) -> weights
    layers: list[dict[str, ColumnLora | RowLora]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(
            w.a.nelement() * w.a.element_size() + w.b.nelement() * w.b.element_size()
            for layer in self.layers
            for w in layer.values()
        )


def load_lora_adapter(
    name: str,
    directory: Path,
    targets: LoraTargets,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int = 0,
) -> LoraAdapter:
    """Read, check against the model and shard a PEFT LoRA adapter; any
    problem raises AdapterError before anything is kept."""
    config = read_lora_config(directory, max_rank)
    paths = _paths_with_fused(targets)
    chosen = resolve_targets(config, paths)
    raw = _split_fused(_read_matrices(directory, paths, targets, chosen), targets)
    r = config.rank
    for (layer, proj), pair in raw.items():
        shape = targets.projections[proj]
        _check_shapes(layer, shape, pair, r)
    names = {proj for _, proj in raw}
    adapter = LoraAdapter(
        name=name,
        rank=r,
        scale=config.scale,
        target_modules=tuple(m for m in LORA_MODULES if m in names),
    )
    for layer in range(targets.num_layers):
        adapter.layers.append(
            _shard_layer(layer, raw, targets, r=r, scale=config.scale, dtype=dtype, device=device)
        )
    return adapter


def _paths_with_fused(targets: LoraTargets) -> dict[str, str]:
    """The targetable module paths (-> projection name), with the fused modules
    whose parts the model has (-> the fused name)."""
    paths = targets.module_paths()
    for i in range(targets.num_layers):
        for fused, parts in FUSED_MODULES.items():
            if all(p in targets.projections for p in parts):
                block = targets.projections[parts[0]].block
                paths[f"model.layers.{i}.{block}.{fused}"] = fused
    return paths


def _split_fused(
    raw: dict[tuple[int, str], dict[str, torch.Tensor]], targets: LoraTargets
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Each fused module's pair as one pair per part: the fused A, and the
    part's rows of B."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (layer, proj), pair in raw.items():
        parts = FUSED_MODULES.get(proj)
        if parts is None:
            out[(layer, proj)] = pair
            continue
        sizes = [targets.projections[p].out_features for p in parts]
        if pair["B"].shape[0] != sum(sizes):
            raise AdapterError(
                f"layer {layer} {proj}: lora_B has {pair['B'].shape[0]} rows, the model's "
                f"{' + '.join(parts)} have {sum(sizes)}: an adapter of another base model?"
            )
        for part, b in zip(parts, pair["B"].split(sizes), strict=True):
            if (layer, part) in raw:
                raise AdapterError(f"layer {layer}: {part} is targeted on its own and in {proj}")
            out[(layer, part)] = {"A": pair["A"], "B": b}
    return out


def _read_matrices(
    directory: Path, paths: dict[str, str], targets: LoraTargets, chosen: set[str]
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, projection or fused module) -> {"A": ..., "B": ...} for every
    targeted module (``paths``: module path -> its name)."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        why = " (adapter_model.bin is a pickle, which is not read)" if pickled else ""
        raise AdapterError(f"{WEIGHTS_FILE} is missing from {str(directory)!r}{why}")
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.fullmatch(key)
                if m is None:
                    raise AdapterError(
                        f"unexpected tensor {key!r}: only lora_A/lora_B of "
                        f"{', '.join((*LORA_MODULES, *FUSED_MODULES))} are supported"
                    )
                layer, block, proj, which = int(m[1]), m[2], m[3], m[4]
                if layer >= targets.num_layers:
                    raise AdapterError(
                        f"tensor {key!r} is for layer {layer}, but the model has "
                        f"{targets.num_layers} layers (an adapter of another base model?)"
                    )
                if f"model.layers.{layer}.{block}.{proj}" not in chosen:
                    raise AdapterError(
                        f"tensor {key!r} is for a module the adapter's target_modules "
                        "do not select (or one this worker does not support)"
                    )
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point():
                    raise AdapterError(f"tensor {key!r} has dtype {tensor.dtype}, not a float")
                raw.setdefault((layer, proj), {})[which] = tensor
    except AdapterError:
        raise
    except Exception as e:  # a corrupt or truncated file
        raise AdapterError(f"cannot read {WEIGHTS_FILE}: {e}") from e
    missing = sorted(p for p in chosen if len(raw.get((int(p.split(".")[2]), paths[p]), {})) != 2)
    if missing:
        raise AdapterError(
            f"{WEIGHTS_FILE} lacks lora_A/lora_B for {len(missing)} targeted modules, "
            f"e.g. {missing[:3]}"
        )
    return raw


def _check_shapes(
    layer: int, shape: ProjectionShape, pair: dict[str, torch.Tensor], r: int
) -> None:
    a, b = pair["A"], pair["B"]
    want_a, want_b = (r, shape.in_features), (shape.out_features, r)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(
            f"layer {layer} {shape.name}: lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)} do not fit the model's {shape.in_features} -> "
            f"{shape.out_features} projection with rank {r} (expected {want_a} and "
            f"{want_b}): an adapter of another base model?"
        )


def _shard_layer(
    layer: int,
    raw: dict[tuple[int, str], dict[str, torch.Tensor]],
    targets: LoraTargets,
    *,
    r: int,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, ColumnLora | RowLora]:
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=dtype).contiguous().to(device)

    out: dict[str, ColumnLora | RowLora] = {}
    by_module: dict[str, list[ProjectionShape]] = {}
    for proj, shape in targets.projections.items():
        if (layer, proj) in raw:
            by_module.setdefault(shape.fused, []).append(shape)
    for module, shapes in by_module.items():
        if not shapes[0].column:
            (shape,) = shapes
            pair = raw[(layer, shape.name)]
            a = pair["A"].float()[:, shape.lo : shape.hi]
            out[module] = RowLora(put(a), put(pair["B"].float() * scale))
            continue
        # The fused output holds the parts in the model's order; the span runs
        # from the first targeted part's shard to the last one's.
        shapes.sort(key=lambda s: s.fused_start)
        lo = shapes[0].fused_start
        hi = max(s.fused_start + (s.hi - s.lo) for s in shapes)
        a = torch.cat([raw[(layer, s.name)]["A"].float() for s in shapes])
        b = torch.zeros(hi - lo, r * len(shapes))
        for j, s in enumerate(shapes):
            rows = raw[(layer, s.name)]["B"].float()[s.lo : s.hi] * scale
            at = s.fused_start - lo
            b[at : at + rows.shape[0], j * r : (j + 1) * r] = rows
        out[module] = ColumnLora(put(a), put(b), lo, hi)
    return out
