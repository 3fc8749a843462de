"""The attention backend interface.

Per step the runner builds one ``AttentionBatch`` (the flat token batch's
layout: which tokens belong to which request, where each writes its KV and
which pages each reads) and calls ``begin_step`` once; every layer then calls
``forward``, which writes the layer's new keys and values into the cache and
returns the attention output for every token of the batch.

Token order in the flat batch: extend (prefill) sequences first, then decode
sequences, each sequence's tokens contiguous and in position order.

Pages: a sequence names its row of the worker's ``PageTable``
(device/page_table.py), which the runner keeps up to date from the plans'
deltas; a backend reads the rows it needs there (on the device), never a
per-step copy of every page list. ``columns`` holds the per-sequence numbers
as host arrays, so a backend's per-step host work is O(batch) numpy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable


@dataclass
class SequenceSlice:
    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # tokens computed this step
    kv_len: int  # positions [0, kv_len) are valid once this step has written
    row: int  # its row of the batch's page table: pages covering [0, kv_len) first


@dataclass(frozen=True)
class SeqColumns:
    """The batch's sequences as host int64 arrays (one entry per sequence)."""

    q_starts: np.ndarray
    q_lens: np.ndarray
    kv_lens: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, seqs: Sequence[SequenceSlice]) -> SeqColumns:
        n = len(seqs)
        return cls(
            np.fromiter((s.q_start for s in seqs), np.int64, n),
            np.fromiter((s.q_len for s in seqs), np.int64, n),
            np.fromiter((s.kv_len for s in seqs), np.int64, n),
            np.fromiter((s.row for s in seqs), np.int64, n),
        )

    def __len__(self) -> int:
        return int(self.q_lens.shape[0])

    def __getitem__(self, part: slice) -> SeqColumns:
        return SeqColumns(
            self.q_starts[part], self.q_lens[part], self.kv_lens[part], self.rows[part]
        )

    def num_pages(self, page_size: int) -> np.ndarray:
        """Pages each sequence reads: those covering [0, kv_len)."""
        return (self.kv_lens + page_size - 1) // page_size


class ColumnSlices(Sequence[SequenceSlice]):
    """``SeqColumns`` read as SequenceSlices, made on first use (a CUDA-graph
    decode step never reads them: its host work stays numpy)."""

    def __init__(self, cols: SeqColumns) -> None:
        self._cols = cols
        self._made: list[SequenceSlice] | None = None

    def _slices(self) -> list[SequenceSlice]:
        if self._made is None:
            c = self._cols
            parts = (c.q_starts, c.q_lens, c.kv_lens, c.rows)
            self._made = list(map(SequenceSlice, *(a.tolist() for a in parts)))
        return self._made

    def __len__(self) -> int:
        return len(self._cols)

    def __getitem__(self, i: Any) -> Any:
        return self._slices()[i]

    def __iter__(self) -> Iterator[SequenceSlice]:
        return iter(self._slices())


@dataclass
class AttentionBatch:
    seqs: Sequence[SequenceSlice]
    num_extends: int  # seqs[:num_extends] are extends, the rest decodes (q_len 1)
    positions: torch.Tensor  # (T,) int64, position of each token
    write_pages: torch.Tensor  # (T,) int64, page receiving each token's KV
    write_offsets: torch.Tensor  # (T,) int64, slot within that page
    page_size: int
    pages: PageTable  # seqs[i].row's first pages cover its positions; synced
    columns: SeqColumns = field(default=None)  # type: ignore[assignment]  # from seqs if None

    def __post_init__(self) -> None:
        if self.columns is None:
            self.columns = SeqColumns.of(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know about the model (per tensor-parallel rank)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sliding_window: int | None  # the window of the layers this backend serves
    dtype: torch.dtype
    device: torch.device
    # Scores -> cap * tanh(scores / cap) before the mask and softmax (Gemma 2).
    logit_soft_cap: float | None = None
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    # What the KV pages hold (None: ``dtype``): float8_e4m3fn for --kv-cache-dtype fp8_e4m3.
    kv_dtype: torch.dtype | None = None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale


class AttentionBackend(ABC):
    name: str = "base"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def begin_step(self, batch: AttentionBatch) -> None:
        """Prepare for this step's layers (index tensors, kernel plans)."""

    @abstractmethod
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
        """q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim). Writes k, v
        into the cache, returns (T, heads, head_dim). ``sinks``: (heads,) float32
        learned logits (GPT-OSS), each joining its head's softmax denominator as
        exp(sink) with no value."""
