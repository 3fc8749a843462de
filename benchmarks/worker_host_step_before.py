"""The worker's per-step layout code as it was before the page table (commit
b7b9335), kept only so that benchmarks/worker_host_step.py can measure the
old path beside the new one on the same machine and inputs: the model
step's ``_batch`` (every sequence's page list sliced and flattened into
numpy) and FlashInfer's ``begin_step`` / ``begin_graph_step`` (flattened
again by ``paged_layout``), verbatim but for names.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker_service.attention.flashinfer_backend import FlashInferAttention, _stage
from worker_service.device.transfer import to_device


@dataclass
class OldSlice:
    q_start: int
    q_len: int
    kv_len: int
    page_table: list[int]


@dataclass
class OldBatch:
    """The old AttentionBatch: page lists in the slices."""

    seqs: list[OldSlice]
    num_extends: int
    positions: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    page_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def old_batch(
    work: Sequence, page_size: int, device: torch.device
) -> tuple[OldBatch, torch.Tensor]:
    """ModelCompute._batch at b7b9335 (no pending inputs)."""
    n = len(work)
    seqs: list[OldSlice] = []
    tables: list[list[int]] = []
    q_start = 0
    for w in work:
        q_len = len(w.inputs)
        kv_len = w.start + q_len
        table = w.state.pages[: -(-kv_len // page_size)]
        if len(table) * page_size < kv_len:
            raise ValueError(f"slot {w.slot}: its pages do not cover {kv_len} positions")
        seqs.append(OldSlice(q_start, q_len, kv_len, table))
        tables.append(table)
        q_start += q_len
    starts = np.fromiter((w.start for w in work), np.int64, n)
    q_lens = np.fromiter((s.q_len for s in seqs), np.int64, n)
    n_pages = np.fromiter((len(t) for t in tables), np.int64, n)
    seq_of = np.repeat(np.arange(n), q_lens)
    first_row = np.cumsum(q_lens) - q_lens
    positions = np.arange(q_start, dtype=np.int64) - first_row[seq_of] + starts[seq_of]
    flat_tables = np.fromiter(itertools.chain.from_iterable(tables), np.int64)
    table_base = np.cumsum(n_pages) - n_pages
    pages = flat_tables[table_base[seq_of] + positions // page_size]
    ids = np.fromiter(itertools.chain.from_iterable(w.inputs for w in work), np.int64)
    gather = np.zeros((2, 0), np.int64)
    pos_t, pages_t, offsets_t, ids_t, _ = to_device(
        [positions, pages, positions % page_size, ids, gather], device
    )
    return OldBatch(seqs, 0, pos_t, pages_t, offsets_t, page_size), ids_t


@dataclass
class OldPagedLayout:
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    indices: np.ndarray


def old_paged_layout(
    seqs: Sequence[OldSlice], page_size: int, pad_to: int = 0, pad_page: int = 0
) -> OldPagedLayout:
    """flashinfer_backend.paged_layout at b7b9335."""
    n, total = len(seqs), max(len(seqs), pad_to)
    q_lens = np.ones(total, np.int64)
    kv_lens = np.ones(total, np.int64)
    if n:
        q_lens[:n] = np.fromiter((s.q_len for s in seqs), np.int64, n)
        kv_lens[:n] = np.fromiter((s.kv_len for s in seqs), np.int64, n)
    if (q_lens < 1).any() or (kv_lens < q_lens).any():
        raise ValueError("every sequence needs 1 <= q_len <= kv_len")
    n_pages = (kv_lens + page_size - 1) // page_size
    real = n_pages[:n].tolist()
    if any(len(s.page_table) < k for s, k in zip(seqs, real, strict=True)):
        raise ValueError("a page_table does not cover positions [0, kv_len)")
    tables = itertools.chain.from_iterable(
        itertools.islice(s.page_table, k) for s, k in zip(seqs, real, strict=True)
    )
    indices = np.full(int(n_pages.sum()), pad_page, np.int32)
    indices[: sum(real)] = np.fromiter(tables, np.int32, sum(real))
    qo_indptr = np.zeros(total + 1, np.int32)
    kv_indptr = np.zeros(total + 1, np.int32)
    np.cumsum(q_lens, out=qo_indptr[1:])
    np.cumsum(n_pages, out=kv_indptr[1:])
    last = (kv_lens - (n_pages - 1) * page_size).astype(np.int32)
    return OldPagedLayout(qo_indptr, kv_indptr, last, indices)


def old_check_token_order(batch: OldBatch) -> None:
    n, e = len(batch.seqs), batch.num_extends
    starts = np.fromiter((s.q_start for s in batch.seqs), np.int64, n)
    lens = np.fromiter((s.q_len for s in batch.seqs), np.int64, n)
    expected = np.concatenate([[0], np.cumsum(lens)[:-1]]) if n else starts
    if (starts != expected).any() or (lens[e:] != 1).any() or lens.sum() != batch.num_tokens:
        raise ValueError("rows must be extends then q_len-1 decodes, in order, all tokens")


class OldFlashInferAttention(FlashInferAttention):
    """begin_step and begin_graph_step as at b7b9335 (the rest is today's, unchanged
    since: ``_rows``, the wrappers, the fixed graph buffers)."""

    def begin_step(self, batch: Any) -> None:
        old_check_token_order(batch)
        self._plan_done.synchronize()
        ps, e = self.spec.page_size, batch.num_extends
        ext, dec = old_paged_layout(batch.seqs[:e], ps), old_paged_layout(batch.seqs[e:], ps)
        host_rows, dev_rows = self._rows(batch)
        arrays = [ext.qo_indptr, ext.kv_indptr, ext.last_page_len, ext.indices]
        arrays += [dec.kv_indptr, dec.last_page_len, dec.indices]
        host, dev = _stage(arrays + ([] if host_rows is None else [host_rows]), self.spec.device)
        self._rows_now = dev_rows if host_rows is None else dev[7].view(2, -1).long()
        self._prefill_rows = int(ext.qo_indptr[-1])
        if e:
            kw = self._plan_kw
            self._prefill.plan(host[0], host[1], dev[3], host[2], *self._heads, causal=True, **kw)
        self._active_decode = self._decode if len(batch.seqs) > e else None
        if self._active_decode is not None:
            self._decode.plan(host[4], dev[6], host[5], *self._heads, **self._plan_kw)
        self._plan_done.record()

    def begin_graph_step(self, batch: Any, size: int) -> None:
        old_check_token_order(batch)
        self._plan_done.synchronize()
        ps, n = self.spec.page_size, len(batch.seqs)
        lay = old_paged_layout(batch.seqs, ps, pad_to=size, pad_page=self._scratch_page)
        host_rows, dev_rows = self._rows(batch)
        arrays = [lay.kv_indptr, lay.last_page_len, lay.indices]
        host, dev = _stage(arrays + ([] if host_rows is None else [host_rows]), self.spec.device)
        self._graphs[size].plan(host[0], dev[2], host[1], *self._heads, **self._plan_kw)
        rows = self._g_rows[:, :size]
        rows[0].fill_(self._scratch_page * 2 * ps)
        rows[1].fill_(self._scratch_page * 2 * ps + ps)
        if n:
            rows[:, :n].copy_(dev_rows if host_rows is None else dev[3].view(2, n))
        self._rows_now = rows
        self._prefill_rows = 0
        self._active_decode = self._graphs[size]
        self._plan_done.record()
