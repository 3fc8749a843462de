"""Attention test cases the worker tests share: batches of sequences on
random pages, the head shapes and batch kinds the FlashInfer tests sweep."""

from __future__ import annotations

import numpy as np
import torch

from worker_service.attention.base import AttentionBatch, AttentionSpec, SequenceSlice

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
) -> AttentionBatch:
    """Sequences as (q_len, kv_len) on distinct random pages; page num_pages - 1 stays
    free (the CUDA-graph scratch page)."""
    free = torch.randperm(num_pages - 1, generator=gen).tolist()
    seqs, positions, row = [], [], 0
    for q_len, kv_len in [*extends, *((1, n) for n in decodes)]:
        n = -(-kv_len // page_size)
        assert len(free) >= n, "test batch needs more pages"
        seqs.append(SequenceSlice(row, q_len, kv_len, free[:n]))
        free, row = free[n:], row + q_len
        positions += range(kv_len - q_len, kv_len)
    pos = torch.tensor(positions, dtype=torch.int64)
    table = torch.tensor([p for s in seqs for p in s.page_table], dtype=torch.int64)
    first = np.cumsum([0] + [len(s.page_table) for s in seqs])
    pages = pos  # no sequences: empty
    if seqs:
        q_lens = torch.tensor([s.q_len for s in seqs])
        seq_of = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        pages = table[torch.from_numpy(first[:-1])[seq_of] + pos // page_size]
    offsets = pos % page_size
    return AttentionBatch(
        seqs, len(extends), *(t.to(device) for t in (pos, pages, offsets)), page_size=page_size
    )


def spec_for(
    heads: tuple[int, int, int], page_size: int, window: int | None, dtype: torch.dtype, dev: str
) -> AttentionSpec:
    return AttentionSpec(*heads, page_size, window, dtype, torch.device(dev))
