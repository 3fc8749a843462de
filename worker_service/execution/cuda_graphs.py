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

The graphs hold the base model only: a decode step with any LoRA adapter row
runs eagerly (ModelCompute.launch), its per-group matmuls depending on which
rows use which adapter.

``forward(inputs)`` runs the model's decode forward on ``inputs`` (tensors of
one batch size) and returns a tensor whose first dimension is that size, e.g.
the last hidden states or the logits. The tensor ``replay`` returns is the
graph's output buffer: read it before the next replay of the same size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from worker_service.attention.base import AttentionBatch
from worker_service.device.page_table import PageTable

Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]
WARMUP_RUNS = 2  # eager runs of a size before its capture


class GraphAttention(Protocol):
    @property
    def graph_sizes(self) -> tuple[int, ...]: ...

    def graph_size_for(self, batch: AttentionBatch) -> int | None: ...

    def begin_graph_step(self, batch: AttentionBatch, size: int) -> None: ...


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
    ) -> None:
        """``inputs`` are the fixed input buffers, each with at least
        ``max(attention.graph_sizes)`` rows; graphs read their first ``size`` rows."""
        largest = max(attention.graph_sizes, default=0)
        short = [k for k, t in inputs.items() if t.shape[0] < largest]
        if short:
            raise ValueError(f"input buffers shorter than the largest graph: {short}")
        self.attention = attention
        self.forward = forward
        self.inputs = dict(inputs)
        self.page_size = page_size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:size] for name, buf in self.inputs.items()}

    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (a smaller
        graph reuses the larger one's intermediate buffers)."""
        pool = torch.cuda.graph_pool_handle()
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
                    self.forward(views)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(views)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(
        self, batch: AttentionBatch, inputs: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Run ``batch`` (decode-only) through a captured graph; None when no
        captured size holds it and the runner must take the eager path."""
        size = self.attention.graph_size_for(batch)
        if size is None or size not in self.graphs:
            return None
        n = len(batch.seqs)
        for name, value in inputs.items():
            # Rows past n keep stale values: padding whose outputs nobody reads.
            self.inputs[name][:n].copy_(value, non_blocking=True)
        self.attention.begin_graph_step(batch, size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
