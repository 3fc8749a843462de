"""The page layout arithmetic of a step, on the host: FlashInfer's CSR
description of the pages the sequences read (indptr, last page lengths; the
page ids themselves are gathered on the device from the page table), the
token-order check, where each token's K/V row is in the cache, and the
CUDA-graph size a batch replays at. Pure numpy/torch, no FlashInfer: the
flashinfer backend (flashinfer_backend.py) calls it, tests pin it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_service.attention.base import AttentionBatch, SeqColumns
from worker_service.device.kv_quant import FP8_E4M3, quantize_fp8
from worker_service.device.page_table import PageTable


def pick_graph_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """Smallest of ``sizes`` that holds ``n`` rows, None if none does."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


@dataclass
class PagedLayout:
    """FlashInfer's CSR description of the pages some sequences read, but for the
    page indices themselves (gathered on the device): host int32 arrays."""

    qo_indptr: np.ndarray  # (n + 1,) sequence i's query rows: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: np.ndarray  # (n + 1,) its pages: indices[kv_indptr[i]:kv_indptr[i+1]]
    last_page_len: np.ndarray  # (n,) valid slots of its last page, 1..page_size
    counts: np.ndarray  # (real sequences,) pages each reads: kv_indptr's steps, unpadded


def paged_layout(cols: SeqColumns, page_size: int, pad_to: int = 0) -> PagedLayout:
    """Layout of ``cols``, padded with one-token one-page sequences up to ``pad_to``.
    O(sequences): the pages are not read here (``PageTable.gather`` reads them)."""
    n, total = len(cols), max(len(cols), pad_to)
    q_lens = np.ones(total, np.int64)
    kv_lens = np.ones(total, np.int64)
    q_lens[:n] = cols.q_lens
    kv_lens[:n] = cols.kv_lens
    if (q_lens < 1).any() or (kv_lens < q_lens).any():
        raise ValueError("every sequence needs 1 <= q_len <= kv_len")
    n_pages = (kv_lens + page_size - 1) // page_size
    qo_indptr = np.zeros(total + 1, np.int32)
    kv_indptr = np.zeros(total + 1, np.int32)
    np.cumsum(q_lens, out=qo_indptr[1:])
    np.cumsum(n_pages, out=kv_indptr[1:])
    last = (kv_lens - (n_pages - 1) * page_size).astype(np.int32)
    return PagedLayout(qo_indptr, kv_indptr, last, n_pages[:n].astype(np.int32))


def gather_bases(table: PageTable, cols: SeqColumns, counts: np.ndarray) -> np.ndarray:
    """``PageTable.gather``'s bases for ``cols`` reading ``counts`` pages each, after
    checking that their rows hold that many pages."""
    if (table.lengths[cols.rows] < counts).any():
        raise ValueError("a page-table row does not cover positions [0, kv_len)")
    return table.flat_bases(cols.rows, counts)


def check_token_order(batch: AttentionBatch) -> None:
    """Extends first, then decodes with q_len 1, each sequence's rows contiguous."""
    cols, e = batch.columns, batch.num_extends
    n = len(cols)
    expected = np.concatenate([[0], np.cumsum(cols.q_lens)[:-1]]) if n else cols.q_starts
    bad = (cols.q_starts != expected).any() or (cols.q_lens[e:] != 1).any()
    if bad or cols.q_lens.sum() != batch.num_tokens or len(batch.seqs) != n:
        raise ValueError("rows must be extends then q_len-1 decodes, in order, all tokens")


def kv_rows(pages: torch.Tensor, offsets: torch.Tensor, page_size: int) -> torch.Tensor:
    """Row of each token's key in the cache viewed as (pages * 2 * page_size, H, D)."""
    return pages * (2 * page_size) + offsets


def store_kv(
    cache: torch.Tensor,
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Same result as ``KvCache.write``; ``rows`` is (2, T): key rows, value rows.
    An fp8 cache stores k / scales[0] and v / scales[1] quantized (kv_quant.py),
    copied as bytes: index_copy_ has no float8 kernel."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    if cache.dtype == FP8_E4M3:
        raw = flat.view(torch.uint8)
        raw.index_copy_(0, rows[0], quantize_fp8(k, scales[0]).view(torch.uint8))
        raw.index_copy_(0, rows[1], quantize_fp8(v, scales[1]).view(torch.uint8))
        return
    flat.index_copy_(0, rows[0], k.to(cache.dtype))
    flat.index_copy_(0, rows[1], v.to(cache.dtype))


def scale_output(out: torch.Tensor, v_scale: float) -> None:
    """An fp8 cache's value scale on the attention output, in place (what
    FlashInfer's wrappers do after the kernel when given ``v_scale``: done here
    so that a CUDA-graph capture, and the CPU harness's stand-in for one, sees
    it as an op of ours)."""
    out.mul_(v_scale)
