"""A step's LoRA work: the token rows of the flat batch grouped by adapter,
and the deltas the model's projections add for them.

The model's column and row linears (models/layers.py) look at the model's
``LoraContext``; it holds a ``LoraBatch`` only while a step that has an
adapter row runs, so a base-only step costs one attribute test per
projection. Per group: out[rows, span] += ((x[rows] A^T) B^T), A and B being
this rank's shards with the scale folded into B (adapter.py). A group whose
rows are one contiguous run (one request, or neighbours) is sliced; others
are gathered with index_select and scattered back with index_add_.

This is the torch path, used on CPU and CUDA alike. FlashInfer's segment
GEMM would run all groups of a projection in one launch; it is not wired in
(issue 17's follow-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from worker_service.device.transfer import to_device
from worker_service.lora.adapter import ColumnLora, LoraAdapter, RowLora


@dataclass(frozen=True)
class LoraGroup:
    adapter: LoraAdapter
    rows: slice | torch.Tensor  # token rows of the step: a run, or their indices


@dataclass
class LoraBatch:
    groups: list[LoraGroup]

    def column(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the deltas of a fused column-parallel module to its output."""
        for g in self.groups:
            w = g.adapter.layers[layer].get(module)
            if w is None:
                continue
            assert isinstance(w, ColumnLora)
            _add(out[:, w.lo : w.hi], x, g.rows, w)

    def row(self, layer: int, module: str, x: torch.Tensor, partial: torch.Tensor) -> None:
        """Add a row-parallel module's deltas to this rank's partial sums
        (before the all-reduce that sums the ranks' parts)."""
        for g in self.groups:
            w = g.adapter.layers[layer].get(module)
            if w is None:
                continue
            assert isinstance(w, RowLora)
            _add(partial, x, g.rows, w)


def _add(
    out: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor, w: ColumnLora | RowLora
) -> None:
    if isinstance(rows, slice):
        out[rows] += F.linear(F.linear(x[rows], w.a), w.b)
    else:
        out.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), w.a), w.b))


@dataclass
class LoraContext:
    """The model's handle on the running step's LoRA work (None: base only)."""

    batch: LoraBatch | None = None


@dataclass(frozen=True)
class LoraSite:
    """Where a projection sits, for looking up its adapter weights."""

    context: LoraContext
    layer: int
    module: str  # qkv_proj, o_proj, gate_up_proj, down_proj


@dataclass
class _Rows:
    adapter: LoraAdapter
    runs: list[tuple[int, int]] = field(default_factory=list)  # [start, end)


def build_lora_batch(
    spans: Sequence[tuple[LoraAdapter | None, int, int]], device: torch.device
) -> LoraBatch | None:
    """Group a step's requests by adapter. ``spans``: per request (adapter or
    None for the base model, first token row, number of rows). None when no
    row uses an adapter: the step then runs the base model alone."""
    by_adapter: dict[int, _Rows] = {}
    for adapter, start, n in spans:
        if adapter is None or n == 0:
            continue
        rows = by_adapter.setdefault(id(adapter), _Rows(adapter))
        if rows.runs and rows.runs[-1][1] == start:  # neighbours: one run
            rows.runs[-1] = (rows.runs[-1][0], start + n)
        else:
            rows.runs.append((start, start + n))
    if not by_adapter:
        return None
    # Requests of one adapter that are not neighbours: their rows as one
    # index tensor per adapter, all sent in one copy.
    scattered = [r for r in by_adapter.values() if len(r.runs) > 1]
    rows = [
        np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in r.runs]) for r in scattered
    ]
    indices = to_device(rows, device)
    gathered = {id(r): t for r, t in zip(scattered, indices, strict=True)}
    groups = [
        LoraGroup(r.adapter, gathered[id(r)] if id(r) in gathered else slice(*r.runs[0]))
        for r in by_adapter.values()
    ]
    return LoraBatch(groups)
