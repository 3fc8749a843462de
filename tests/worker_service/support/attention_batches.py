"""Attention test cases the worker tests share: batches of sequences on
random pages, the head shapes and batch kinds the FlashInfer tests sweep."""

from __future__ import annotations

import numpy as np
import torch

from worker_service.attention.base import AttentionBatch, AttentionSpec, SequenceSlice
from worker_service.device.page_table import PageTable

HEADS = [(8, 2, 128), (4, 4, 64), (12, 2, 64)]  # GQA group 4, 1 and 6
BATCHES = {
    "mixed": ([(17, 17), (5, 40), (1, 23)], [1, 9, 33, 70]),
    "extend_only": ([(30, 30), (16, 50)], []),
    "decode_only": ([], [5, 16, 17, 100, 64]),
}


def make_batch(
    extends: list[tuple[int, int]],
    decodes: list[int],
    page_size: int,
    num_pages: int,
    gen: torch.Generator,
    device: str = "cpu",
    *,
    table_device: str | None = None,
) -> AttentionBatch:
    """Sequences as (q_len, kv_len) on distinct random pages, each on a page-table
    row of its own (rows taken out of order, as a runner's come free); page
    num_pages - 1 stays free (the CUDA-graph scratch page). The write positions
    go to ``device``, the page table to ``table_device`` (default: the same;
    the backends read it where they run)."""
    free = torch.randperm(num_pages - 1, generator=gen).tolist()
    table = PageTable(table_device or device, rows=2, columns=2)  # grows, as the runner's
    spare = [table.acquire() for _ in range(3)]  # rows held by requests not in this step
    table.release(spare[1])
    seqs, positions, lists, row = [], [], [], 0
    for q_len, kv_len in [*extends, *((1, n) for n in decodes)]:
        n = -(-kv_len // page_size)
        assert len(free) >= n, "test batch needs more pages"
        table_row = table.acquire()
        table.append(table_row, free[:n])
        seqs.append(SequenceSlice(row, q_len, kv_len, table_row))
        lists.append(free[:n])
        free, row = free[n:], row + q_len
        positions += range(kv_len - q_len, kv_len)
    table.sync()
    pos = torch.tensor(positions, dtype=torch.int64)
    flat = torch.tensor([p for pages in lists for p in pages], dtype=torch.int64)
    first = np.cumsum([0] + [len(pages) for pages in lists])
    pages = pos  # no sequences: empty
    if seqs:
        q_lens = torch.tensor([s.q_len for s in seqs])
        seq_of = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        pages = flat[torch.from_numpy(first[:-1])[seq_of] + pos // page_size]
    offsets = pos % page_size
    moved = (t.to(device) for t in (pos, pages, offsets))
    return AttentionBatch(seqs, len(extends), *moved, page_size=page_size, pages=table)


def pages_of(batch: AttentionBatch, seq: SequenceSlice) -> list[int]:
    """The pages ``seq`` reads: the first of its page-table row covering [0, kv_len)."""
    n = -(-seq.kv_len // batch.page_size)
    return batch.pages.host[seq.row, :n].tolist()


def spec_for(
    heads: tuple[int, int, int], page_size: int, window: int | None, dtype: torch.dtype, dev: str
) -> AttentionSpec:
    return AttentionSpec(*heads, page_size, window, dtype, torch.device(dev))
