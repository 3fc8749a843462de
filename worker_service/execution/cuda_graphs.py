"""CUDA graphs for decode steps, generic over the attention backend.

A decode step's shapes depend only on its batch size, so the runner captures
its decode forward once per size and replays the smallest captured size that
holds a step's batch, the extra rows being padding. Replaying a graph re-runs
its kernels on the same addresses, so every per-step input must be copied into
fixed buffers first. For the model that is the runner's inputs (token ids,
positions, ...: ``inputs`` below); for attention it is the page layout, which
the backend rewrites in ``begin_graph_step`` (FlashInfer plans there, outside
the graph, as it requires). Any backend with the ``GraphAttention`` methods
works; ``FlashInferAttention`` has them once ``enable_decode_graphs`` ran.

Runner usage::

    attn.enable_decode_graphs(scratch_page, max_pages_per_seq)
    graphs = DecodeGraphs(attn, forward, {"ids": ids_buf, "positions": pos_buf}, page_size)
    graphs.capture()
    ...
    out = graphs.replay(batch, {"ids": ids, "positions": positions})
    if out is None:  # no captured size fits: eager step
        attn.begin_step(batch)
        out = forward({"ids": ids, "positions": positions})

Drafted (speculative) steps: ``DecodeGraphs(attn.verify_graphs, forward,
inputs, page_size, rows_per_seq=k + 1)`` captures per number of sequences a
forward of ``rows_per_seq`` rows each; ``pad_verify_batch`` turns a drafted
step (every sequence a drafted extend of at most k drafts, or a decode) into
that shape, the rows a sequence did not draft writing the scratch page.

Decode steps with LoRA rows replay graphs of their own whose forward reads
the adapters from fixed slots (lora/graph_slots.py; ModelCompute.lora_graphs),
the row -> slot map being one more input.

``forward(inputs)`` runs the model's decode forward on ``inputs`` (tensors of
one batch size) and returns a tensor whose first dimension is that size: the
final hidden states (ModelCompute runs the LM head after the replay, eagerly).

Memory. All sizes capture into one memory pool: a graph's intermediates live
there, and a later (smaller) capture reuses the blocks an earlier one freed,
so the pool costs about what the largest graph needs, not the sum. Graph
outputs must not stay there: a smaller graph's output may sit in blocks that
were a larger graph's intermediates, and replaying the larger one would
overwrite it. So each graph's last captured op copies its output into a
buffer of its own allocated outside the pool (``keep_output``), and ``replay``
returns a view of that buffer: it holds until the next replay of the same
size, whatever other sizes replay meanwhile. Those buffers are rows x
hidden x 2 bytes per size (8 KiB a row for a 4096-wide bf16 model; 4.2k rows
over the default sizes, ~35 MB), which is why the forward stops before the LM
head: logits per size would be rows x vocabulary x 4 bytes (2.2 GB at a 128k
vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from worker_service.attention.base import AttentionBatch, ColumnSlices, SeqColumns
from worker_service.device.page_table import PageTable
from worker_service.device.transfer import to_device

Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]
WARMUP_RUNS = 2  # eager runs of a size before its capture


class GraphAttention(Protocol):
    @property
    def graph_sizes(self) -> tuple[int, ...]: ...

    def graph_size_for(self, batch: AttentionBatch) -> int | None: ...

    def begin_graph_step(self, batch: AttentionBatch, size: int) -> None: ...


def keep_output(held: torch.Tensor, out: torch.Tensor) -> None:
    """A graph's output copied into its buffer outside the pool (a captured op;
    the CPU harness records it like a kernel)."""
    held.copy_(out)


def empty_decode_batch(page_size: int, device: torch.device | str = "cpu") -> AttentionBatch:
    """A decode batch with no sequences: every row of a graph step is padding."""
    none = torch.zeros(0, dtype=torch.int64, device=device)
    return AttentionBatch(
        seqs=[],
        num_extends=0,
        positions=none,
        write_pages=none,
        write_offsets=none,
        page_size=page_size,
        pages=PageTable("cpu", rows=1, columns=1),  # no sequence reads a row
    )


class DecodeGraphs:
    def __init__(
        self,
        attention: GraphAttention,
        forward: Forward,
        inputs: Mapping[str, torch.Tensor],
        page_size: int,
        *,
        rows_per_seq: int = 1,
    ) -> None:
        """``inputs`` are the fixed input buffers, each with at least
        ``max(attention.graph_sizes) * rows_per_seq`` rows; the graph of ``size``
        sequences reads their first ``size * rows_per_seq`` rows."""
        largest = max(attention.graph_sizes, default=0) * rows_per_seq
        short = [k for k, t in inputs.items() if t.shape[0] < largest]
        if short:
            raise ValueError(f"input buffers shorter than the largest graph: {short}")
        self.attention = attention
        self.forward = forward
        self.inputs = dict(inputs)
        self.page_size = page_size
        self.rows_per_seq = rows_per_seq
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        rows = size * self.rows_per_seq
        return {name: buf[:rows] for name, buf in self.inputs.items()}

    def capture(self, pool: Any = None) -> None:
        """Capture every size, largest first, all in one memory pool (a smaller
        graph reuses the larger one's intermediate buffers; ``pool``: one shared
        with other DecodeGraphs, else a new one); each output is kept outside the
        pool (module docstring)."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        empty = empty_decode_batch(self.page_size)
        for size in sorted(self.attention.graph_sizes, reverse=True):
            views = self._views(size)
            self.attention.begin_graph_step(empty, size)
            # Warm up on a side stream so lazy initialisation (library handles,
            # kernel module loading) happens before, not inside, the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    warm = self.forward(views)
            torch.cuda.current_stream().wait_stream(side)
            # Allocated here, before the capture: the caching allocator's own
            # memory, which no graph of the pool can hand to another.
            held = torch.empty_like(warm)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                keep_output(held, self.forward(views))
            self.graphs[size] = (graph, held)
        torch.cuda.synchronize()

    def replay(
        self, batch: AttentionBatch, inputs: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Run ``batch`` (decode-only) through a captured graph; None when no
        captured size holds it and the runner must take the eager path."""
        size = self.attention.graph_size_for(batch)
        if size is None or size not in self.graphs:
            return None
        # One batch, or (layer groups) one per group, sharing their sequences.
        seqs = batch.seqs if isinstance(batch, AttentionBatch) else next(iter(batch.values())).seqs
        n = len(seqs) * self.rows_per_seq
        for name, value in inputs.items():
            # Rows past n keep stale values: padding whose outputs nobody reads.
            self.inputs[name][:n].copy_(value, non_blocking=True)
        self.attention.begin_graph_step(batch, size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]


def pad_verify_batch(
    batch: AttentionBatch,
    ids: torch.Tensor,
    *,
    rows_per_seq: int,
    scratch_page: int,
) -> tuple[AttentionBatch, torch.Tensor, np.ndarray]:
    """``batch`` (sequences of 1..rows_per_seq query rows: drafted extends and
    decodes) with every sequence padded to ``rows_per_seq`` rows, as verify
    graphs take it; also its input ids and, per real row, its padded row.

    A padded row continues its sequence (its KV length grows by the padding;
    past the pages its row holds, the attention reads the scratch page:
    ``FlashInferAttention.begin_verify_graph_step``), but writes its K/V to the
    scratch page and takes the position of the sequence's last real row (any
    position the rotary table holds will do: its output is never read). The
    causal mask keeps every real row from seeing the padded positions."""
    q, ps, cols = rows_per_seq, batch.page_size, batch.columns
    n = len(cols)
    if ((cols.q_lens < 1) | (cols.q_lens > q)).any():
        raise ValueError(f"a sequence of more than {q} rows does not fit {q}-row verify graphs")
    starts = cols.kv_lens - cols.q_lens  # each sequence's first position this step
    firsts = np.arange(n, dtype=np.int64) * q  # its first row in the padded batch
    # Row r of sequence i: position starts[i] + r for a real row, else the
    # sequence's last real position (padding: any position the rotary table holds).
    r = np.tile(np.arange(q, dtype=np.int64), n)
    seq = np.repeat(np.arange(n, dtype=np.int64), q)
    is_real = r < cols.q_lens[seq]
    positions = np.where(is_real, starts[seq] + r, cols.kv_lens[seq] - 1)
    real_pos = positions[is_real]
    pages = np.full(n * q, scratch_page, np.int64)
    pages[is_real] = batch.pages.host[cols.rows[seq[is_real]], real_pos // ps]
    offsets = np.where(is_real, positions % ps, 0)
    dest = np.flatnonzero(is_real).astype(np.int64)
    pos_t, pages_t, offsets_t, dest_t = to_device([positions, pages, offsets, dest], ids.device)
    padded_ids = torch.zeros(n * q, dtype=ids.dtype, device=ids.device)
    padded_ids.index_copy_(0, dest_t, ids)
    padded_cols = SeqColumns(firsts, np.full(n, q, np.int64), starts + q, cols.rows)
    padded = AttentionBatch(
        seqs=ColumnSlices(padded_cols),
        num_extends=n,
        positions=pos_t,
        write_pages=pages_t,
        write_offsets=offsets_t,
        page_size=ps,
        pages=batch.pages,
        columns=padded_cols,
    )
    return padded, padded_ids, dest
