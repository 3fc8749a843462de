"""Attention for models whose layers differ in window (Gemma 2/3, GPT-OSS): one
backend per layer group, each with its own ``AttentionSpec``.

Groups: "full" (layers without a window) and "sliding" (layers with the
model's one sliding window); ``layer_groups`` reads them off the per-layer
windows (``ModelConfig.window_of``) and returns None when every layer has the
same window: such a model gets one backend, exactly as before groups existed.

Per step the runner hands ``begin_step`` one ``AttentionBatch`` per group
(a mapping), or one batch that every group reads: while the groups share one
page table and KV pool the batches are the same object. The per-group batch is
the seam where the sliding group gets a page table, write pages and pool of its
own (sliding-window memory): nothing here assumes the batches are equal.
``forward(layer, ...)`` runs the layer's group's backend on the global layer
index (the KV cache is indexed by it).

CUDA graphs: where every group's backend has them (FlashInfer), the grouped
attention has them too (``GroupedGraphAttention``): each backend enables,
plans and sizes its own graphs, a step's size is the largest any group
picks, and one captured forward runs every layer's kernels, each reading its
group's fixed buffers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker_service.attention.base import AttentionBackend, AttentionBatch, AttentionSpec
from worker_service.device.kv_cache import KvCache

FULL, SLIDING = "full", "sliding"

Batches = AttentionBatch | Mapping[str, AttentionBatch]


def one_batch(batches: Batches) -> AttentionBatch:
    """A batch whose sequences and positions are every group's (they share them)."""
    return batches if isinstance(batches, AttentionBatch) else next(iter(batches.values()))


@dataclass(frozen=True)
class LayerGroups:
    """Which group each layer belongs to, and each group's window."""

    of_layer: tuple[str, ...]  # the group of layer i
    windows: dict[str, int | None]  # group -> its window (None: full attention)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.windows)

    def specs(self, base: AttentionSpec) -> dict[str, AttentionSpec]:
        """Each group's spec: ``base`` with the group's window."""
        return {g: dataclasses.replace(base, sliding_window=w) for g, w in self.windows.items()}


def layer_groups(windows: Sequence[int | None]) -> LayerGroups | None:
    """The groups of layers with these windows; None when all share one window
    (one backend serves the model). Refuses more than one sliding window."""
    distinct = set(windows)
    if len(distinct) <= 1:
        return None
    sliding = {w for w in distinct if w is not None}
    if len(sliding) > 1:
        raise ValueError(f"layers with sliding windows {sorted(sliding)}: one window per model")
    (window,) = sliding
    return LayerGroups(
        tuple(FULL if w is None else SLIDING for w in windows), {FULL: None, SLIDING: window}
    )


class GroupedAttention:
    """The model's ``attn`` when its layers differ in window (module docstring)."""

    def __init__(self, backends: Mapping[str, AttentionBackend], groups: LayerGroups) -> None:
        if set(backends) != set(groups.names):
            raise ValueError(f"backends for {sorted(backends)}, groups {sorted(groups.names)}")
        names = {b.name for b in backends.values()}
        if len(names) != 1:
            raise ValueError(f"one attention backend kind for all groups, not {sorted(names)}")
        self.backends = dict(backends)
        self.groups = groups
        self.name = names.pop()
        self._of_layer = [self.backends[g] for g in groups.of_layer]

    @property
    def decode_kernel(self) -> Any:
        """The CPU decode kernel the groups' torch backends share, if any."""
        return getattr(next(iter(self.backends.values())), "decode_kernel", None)

    def batches(self, batch: Batches) -> dict[str, AttentionBatch]:
        """One batch per group: ``batch`` itself for every group when it is one."""
        if isinstance(batch, AttentionBatch):
            return dict.fromkeys(self.backends, batch)
        if set(batch) != set(self.backends):
            raise ValueError(f"batches for {sorted(batch)}, groups {sorted(self.backends)}")
        return dict(batch)

    def begin_step(self, batches: Batches) -> None:
        for group, batch in self.batches(batches).items():
            self.backends[group].begin_step(batch)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv: KvCache,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._of_layer[layer].forward(layer, q, k, v, kv=kv, sinks=sinks)


class GroupedGraphAttention(GroupedAttention):
    """GroupedAttention over backends with CUDA graphs (FlashInferAttention's
    methods: enable_decode_graphs, graph_sizes, graph_size_for, begin_graph_step,
    enable_verify_graphs, verify_graphs)."""

    verify_graphs: GroupedVerifyGraphs | None = None

    def enable_decode_graphs(
        self, scratch_page: int | Mapping[str, int], max_pages_per_seq: int, **kwargs: Any
    ) -> None:
        """``scratch_page``: one for all groups (one KV pool), or each group's
        (two pools: each pads onto its own pool's scratch page)."""
        for group, backend in self.backends.items():
            scratch = scratch_page if isinstance(scratch_page, int) else scratch_page[group]
            backend.enable_decode_graphs(scratch, max_pages_per_seq, **kwargs)  # type: ignore[attr-defined]

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return _common_sizes(b.graph_sizes for b in self.backends.values())  # type: ignore[attr-defined]

    def graph_size_for(self, batch: Batches) -> int | None:
        sizes = [
            self.backends[g].graph_size_for(b)  # type: ignore[attr-defined]
            for g, b in self.batches(batch).items()
        ]
        return None if None in sizes else max(sizes)  # type: ignore[type-var]

    def begin_graph_step(self, batch: Batches, size: int) -> None:
        for group, b in self.batches(batch).items():
            self.backends[group].begin_graph_step(b, size)  # type: ignore[attr-defined]

    def enable_verify_graphs(self, rows_per_seq: int, **kwargs: Any) -> None:
        for backend in self.backends.values():
            backend.enable_verify_graphs(rows_per_seq, **kwargs)  # type: ignore[attr-defined]
        parts = {g: b.verify_graphs for g, b in self.backends.items()}  # type: ignore[attr-defined]
        self.verify_graphs = GroupedVerifyGraphs(self, parts)


@dataclass(frozen=True)
class GroupedVerifyGraphs:
    """The groups' verify graphs as one ``GraphAttention`` (cuda_graphs.py)."""

    attention: GroupedGraphAttention
    parts: dict[str, Any]  # group -> its backend's VerifyGraphs

    @property
    def rows_per_seq(self) -> int:
        return _one({p.rows_per_seq for p in self.parts.values()})

    @property
    def scratch_page(self) -> int:
        return _one({p.scratch_page for p in self.parts.values()})

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return _common_sizes(p.graph_sizes for p in self.parts.values())

    def graph_size_for(self, batch: Batches) -> int | None:
        batches = self.attention.batches(batch)
        sizes = [self.parts[g].graph_size_for(b) for g, b in batches.items()]
        return None if None in sizes else max(sizes)

    def begin_graph_step(self, batch: Batches, size: int) -> None:
        for group, b in self.attention.batches(batch).items():
            self.parts[group].begin_graph_step(b, size)


def group_attention(
    backends: Mapping[str, AttentionBackend], groups: LayerGroups
) -> GroupedAttention:
    """Grouped attention, with CUDA graphs where every backend has them."""
    if all(hasattr(b, "enable_decode_graphs") for b in backends.values()):
        return GroupedGraphAttention(backends, groups)
    return GroupedAttention(backends, groups)


def _common_sizes(per_group: Any) -> tuple[int, ...]:
    sizes = {tuple(s) for s in per_group}
    if len(sizes) != 1:
        raise ValueError(f"the groups' graph sizes differ: {sorted(sizes)}")
    return sizes.pop()


def _one(values: set[int]) -> int:
    if len(values) != 1:
        raise ValueError(f"the groups' graphs differ: {sorted(values)}")
    return values.pop()


Attention = AttentionBackend | GroupedAttention
