"""LoRA in CUDA graphs: adapters in a fixed number of slots of fixed buffers.

A captured graph bakes in its tensors' addresses and shapes, so the grouped
path of batch.py (groups, row sets and weight tensors chosen per step) cannot
be captured. Here every adapter a decode step uses is first copied into one of
``slots`` slots of per-layer, per-module buffers (rank padded with zeros to
``max_rank``), and a projection's delta is, for all rows at once,

    out += ((x A^T) * mask) B^T

with A (slots * width, in) and B (out, slots * width) the slots stacked,
``width`` the rank columns of a slot (parts x max_rank for a fused column
module), and ``mask`` keeping, per row, the columns of its own slot (a base
row's slot is -1: no column). The shapes depend on the rows only, the row ->
slot map is one more graph input: one graph per decode size serves any mix of
adapters that fits the slots. The cost is a rank slots x width LoRA on every
row (the zero columns are multiplied too), which for decode steps, bound by
reading the weights, is small beside the base model's.

Slots are filled on the executing thread before the step's kernels are
queued, on the same stream, so a slot rewritten for step N+1 is read by step
N's kernels before the copy (overlap). An adapter stays in its slot until a
step needs the slot for another adapter (least recently used first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker_service.lora.adapter import ColumnLora, LoraAdapter, RowLora
from worker_service.lora.targets import LoraTargets

# Fused column modules and how many projections they hold.
COLUMN_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
ROW_MODULES = ("o_proj", "down_proj")


@dataclass
class _Stacked:
    a: torch.Tensor  # (slots * width, in_features of this rank)
    b: torch.Tensor  # (out_features of this rank, slots * width)
    width: int


@dataclass
class LoraSlots:
    """Adapter weights of up to ``slots`` adapters in fixed buffers (module docstring)."""

    slots: int
    max_rank: int
    layers: list[dict[str, _Stacked]]
    held: list[LoraAdapter | None] = field(default_factory=list)
    _used: list[int] = field(default_factory=list)  # step count of each slot's last use
    _steps: int = 0

    @classmethod
    def create(
        cls,
        targets: LoraTargets,
        *,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoraSlots:
        shapes = {p.fused: p for p in targets.projections.values()}
        layers: list[dict[str, _Stacked]] = []
        for _ in range(targets.num_layers):
            modules: dict[str, _Stacked] = {}
            for module, parts in COLUMN_PARTS.items():
                if module in shapes:  # input whole, output this rank's fused shard
                    width = parts * max_rank
                    in_f, out_f = shapes[module].in_features, targets.fused_widths[module]
                    modules[module] = _stacked(
                        slots, width, in_f, out_f, dtype=dtype, device=device
                    )
            for module in ROW_MODULES:
                if module in shapes:  # input this rank's shard, output whole
                    p = shapes[module]
                    in_f, out_f = p.hi - p.lo, p.out_features
                    modules[module] = _stacked(
                        slots, max_rank, in_f, out_f, dtype=dtype, device=device
                    )
            layers.append(modules)
        return cls(slots, max_rank, layers, [None] * slots, [0] * slots)

    def assign(self, adapters: list[LoraAdapter]) -> dict[int, int] | None:
        """Slot of each of ``adapters`` (by id), copying in those not held yet;
        None when they cannot all be held (too many, or a rank above max_rank):
        the step then runs eagerly."""
        distinct = list({id(a): a for a in adapters}.values())
        if len(distinct) > self.slots or any(a.rank > self.max_rank for a in distinct):
            return None
        self._steps += 1
        where = {id(a): i for i, a in enumerate(self.held) if a is not None}
        needed = {id(a) for a in distinct}
        free = sorted(
            (i for i, a in enumerate(self.held) if a is None or id(a) not in needed),
            key=lambda i: (self.held[i] is not None, self._used[i]),
        )
        for adapter in distinct:
            if id(adapter) not in where:
                slot = free.pop(0)
                self._load(slot, adapter)
                where[id(adapter)] = slot
            self._used[where[id(adapter)]] = self._steps
        return {key: where[key] for key in needed}

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for layer, stacked in zip(adapter.layers, self.layers, strict=True):
            for module, s in stacked.items():
                cols = slice(slot * s.width, (slot + 1) * s.width)
                s.a[cols].zero_()
                s.b[:, cols].zero_()
                w = layer.get(module)
                if isinstance(w, ColumnLora):
                    r = w.a.shape[0]
                    s.a[cols.start : cols.start + r].copy_(w.a)
                    s.b[w.lo : w.hi, cols.start : cols.start + r].copy_(w.b)
                elif isinstance(w, RowLora):
                    r = w.a.shape[0]
                    s.a[cols.start : cols.start + r].copy_(w.a)
                    s.b[:, cols.start : cols.start + r].copy_(w.b)
        self.held[slot] = adapter


def _stacked(
    slots: int, width: int, in_f: int, out_f: int, *, dtype: torch.dtype, device: torch.device
) -> _Stacked:
    a = torch.zeros(slots * width, in_f, dtype=dtype, device=device)
    b = torch.zeros(out_f, slots * width, dtype=dtype, device=device)
    return _Stacked(a, b, width)


@dataclass
class SlotLoraBatch:
    """The model's LoRA work for a step over ``LoraSlots`` (the interface of
    batch.LoraBatch): ``row_slot`` (rows,) int64, each row's slot, -1 for base."""

    slots: LoraSlots
    row_slot: torch.Tensor
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        if width not in self._masks:
            col_slot = torch.arange(self.slots.slots * width, device=self.row_slot.device) // width
            self._masks[width] = (self.row_slot[:, None] == col_slot[None, :]).to(dtype)
        return self._masks[width]

    def column(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        s = self.slots.layers[layer].get(module)
        if s is not None:
            out += F.linear(F.linear(x, s.a) * self._mask(s.width, x.dtype), s.b)

    def row(self, layer: int, module: str, x: torch.Tensor, partial: torch.Tensor) -> None:
        s = self.slots.layers[layer].get(module)
        if s is not None:
            partial += F.linear(F.linear(x, s.a) * self._mask(s.width, x.dtype), s.b)
