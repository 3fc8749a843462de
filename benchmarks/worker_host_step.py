"""The worker's per-step HOST work of building a decode step's layout, before
and after the page table (issue 31), on the CPU (a program, not a test).

What is timed, per step, for ``--batch`` requests at ``--context`` tokens
(page size 16), each step appending one token to every request and a page
to the requests whose KV crosses a page boundary (staggered: 1/16 of them
per step):

- before (the code at b7b9335, kept in worker_host_step_before.py):
  ``ModelCompute._batch`` (each sequence's page list sliced and flattened
  into numpy) and FlashInfer's ``begin_step`` / ``begin_graph_step`` (the
  lists flattened again into indices, staged);
- after (this tree): the page table's deltas (``PageTable.append``,
  ``deltas``), the real ``ModelCompute._batch`` and the real
  ``FlashInferAttention.begin_step`` / ``begin_graph_step``, with
  FlashInfer's wrappers stubbed (their ``plan`` is FlashInfer's host work,
  the same on both sides, and needs a GPU) and its CUDA calls made plain
  CPU calls (pinning and copies cost what they cost on both sides: left out).
  The device gather of the flat page indices (``PageTable.gather``: three
  kernels on a GPU, queued without waiting) is stubbed out of the host
  figure and timed on its own, on this CPU, as ``gather``.

``--swa``: the after side as a model with sliding-window layers runs it (two
KV pools): every request also holds a row of the sliding page table, which
gets the same deltas, ``_batch`` builds the sliding group's batch too (its
write pages from that table), and each group's backend plans its own step.

The runner's own appends to the page lists are the same on both sides and
left out of both. The sides run in separate passes over equal workloads.
Times are the process's CPU time (``time.process_time``, torch on one
thread): on a shared machine wall time also counts the waits for a core.

Prints medians (ms) and before/after ratios; ``--json PATH`` writes them
after each configuration.

    python benchmarks/worker_host_step.py                      # 1/64/256 x 1k/8k/32k
    python benchmarks/worker_host_step.py --batch 256 --context 32768 --steps 50
    python benchmarks/worker_host_step.py --swa                # two page tables
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.worker_host_step_before import OldFlashInferAttention, old_batch
from worker_service.attention import flashinfer_backend as backend
from worker_service.attention.base import AttentionSpec
from worker_service.device.page_table import PageTable
from worker_service.execution.model_compute import ModelCompute
from worker_service.execution.request_state import SlotState
from worker_service.execution.step_work import SeqWork
from worker_service.sampling.params import LogprobOptions, SamplingParams

PAGE = 16
CPU = torch.device("cpu")
WARMUP = 3  # steps run before the timed ones


class _NoEvent:
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _HostFacilities(backend.CudaFacilities):
    """The backend's CUDA calls as plain CPU ones; write positions count as device
    tensors (the runner puts them there), so the backend takes its device path."""

    def usable(self, device: torch.device) -> bool:
        return True

    def on_host(self, t: torch.Tensor) -> bool:
        return False

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def to_device(self, pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
        return pinned

    def event(self) -> Any:
        return _NoEvent()

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=device)


class _StubWrapper:
    """FlashInfer's wrapper, minus the GPU: ``plan`` keeps its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.planned: tuple = ()

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.planned = args


@contextlib.contextmanager
def flashinfer_on_the_host() -> Iterator[None]:
    import flashinfer

    saved = (
        backend.CUDA,
        flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        flashinfer.BatchDecodeWithPagedKVCacheWrapper,
    )
    backend.CUDA = _HostFacilities()
    flashinfer.BatchPrefillWithPagedKVCacheWrapper = _StubWrapper
    flashinfer.BatchDecodeWithPagedKVCacheWrapper = _StubWrapper
    try:
        yield
    finally:
        backend.CUDA = saved[0]
        flashinfer.BatchPrefillWithPagedKVCacheWrapper = saved[1]
        flashinfer.BatchDecodeWithPagedKVCacheWrapper = saved[2]


class Workload:
    """``batch`` decoding requests of about ``context`` tokens on distinct pages."""

    def __init__(self, batch: int, context: int, seed: int = 0, *, swa: bool = False) -> None:
        rng = random.Random(seed)
        self.table = PageTable(CPU, separate=True)  # as on CUDA: deltas uploaded at sync
        # Two pools: the sliding table, the same deltas (other page ids).
        self.swa_table = PageTable(CPU, separate=True) if swa else None
        self.next_page = 0
        self.states: list[SlotState] = []
        sampling, logprobs = SamplingParams(temperature=0.0), LogprobOptions()
        for i in range(batch):
            kv_len = context - (i % PAGE)  # staggered page boundaries
            state = SlotState(f"r{i}", sampling, logprobs, 1, [1], kv_len)
            state.row = self.table.acquire()
            if self.swa_table is not None:
                assert self.swa_table.acquire() == state.row  # same rows, as the runner's
            self._append(*self._give(state, -(-(kv_len + 1) // PAGE)))
            self.states.append(state)
        rng.shuffle(self.states)  # rows not in batch order

    def _append(self, row: int, new: list[int]) -> None:
        self.table.append(row, new)
        if self.swa_table is not None:
            self.swa_table.append(row, [p + 1 for p in new])

    def _give(self, state: SlotState, pages: int) -> tuple[int, list[int]]:
        new = list(range(self.next_page, self.next_page + pages - len(state.pages)))
        self.next_page += len(new)
        state.pages.extend(new)
        return state.row, new

    def advance(self) -> tuple[float, float, list[SeqWork]]:
        """One decode step's deltas: (list ms, table ms, the step's work)."""
        grown = []
        t0 = time.process_time()
        for s in self.states:
            s.kv_len += 1
            if len(s.pages) * PAGE < s.kv_len + 1:
                grown.append(self._give(s, len(s.pages) + 1))
        t1 = time.process_time()
        for row, new in grown:
            self._append(row, new)
        t2 = time.process_time()
        work = [
            SeqWork(slot=i, state=s, start=s.kv_len, inputs=[1], sample=True)
            for i, s in enumerate(self.states)
        ]
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, work


def _compute(table: PageTable, swa_table: PageTable | None) -> ModelCompute:
    """A ModelCompute with only what ``_batch`` reads (no model: the layout alone)."""
    compute = ModelCompute.__new__(ModelCompute)
    compute.page_size, compute.page_table, compute.device = PAGE, table, CPU
    compute.swa_table = swa_table
    compute.groups = ("full", "sliding") if swa_table is not None else ("full",)
    return compute


def measure(batch: int, context: int, steps: int, mode: str, swa: bool) -> dict[str, float]:
    """The two sides in separate passes over equal workloads (one side's large
    arrays would evict the other's from the CPU caches if they alternated)."""
    spec = AttentionSpec(32, 8, 128, PAGE, None, torch.bfloat16, CPU)
    rows: dict[str, list[float]] = {k: [] for k in ("before", "deltas", "batch", "attn", "gather")}
    for side in ("after", "before"):
        w = Workload(batch, context, swa=swa and side == "after")
        compute = _compute(w.table, w.swa_table)
        scratch = w.next_page + batch * (steps // PAGE + 2)
        attn = (backend.FlashInferAttention if side == "after" else OldFlashInferAttention)(
            spec, workspace_bytes=1024
        )
        attn.enable_decode_graphs(scratch, -(-(context + steps + PAGE) // PAGE), sizes=(batch,))
        # Two pools: the sliding group's backend (window 512), planning its own batch.
        backends = {"full": attn}
        if w.swa_table is not None:
            sliding = dataclasses.replace(spec, sliding_window=512)
            backends["sliding"] = backend.FlashInferAttention(sliding, workspace_bytes=1024)
            backends["sliding"].enable_decode_graphs(
                scratch + 1, -(-(context + steps + PAGE) // PAGE), sizes=(batch,)
            )
        real_gather = w.table.gather
        host_gather = lambda bases, counts, total, *, out: out[:total]  # noqa: E731
        if w.swa_table is not None:
            w.swa_table.gather = host_gather  # type: ignore[method-assign]
        for step in range(WARMUP + steps):
            _, table_ms, work = w.advance()
            if side == "before":
                t0 = time.process_time()
                old, _ = old_batch(work, PAGE, CPU)
                if mode == "graph":
                    attn.begin_graph_step(old, batch)
                else:
                    attn.begin_step(old)
                if step >= WARMUP:
                    rows["before"].append((time.process_time() - t0) * 1e3)
                continue
            w.table.gather = host_gather  # type: ignore[method-assign]
            t2 = time.process_time()
            batches, _ = compute._batch(work, 0)
            t3 = time.process_time()
            for group, group_batch in batches.items():
                if mode == "graph":
                    backends[group].begin_graph_step(group_batch, batch)
                else:
                    backends[group].begin_step(group_batch)
            t4 = time.process_time()
            new = batches["full"]
            if step >= WARMUP:  # first touches of fresh buffers, the table's growth
                rows["deltas"].append(table_ms)
                rows["batch"].append((t3 - t2) * 1e3)
                rows["attn"].append((t4 - t3) * 1e3)
        if side == "after":
            # Apart from the steps: on a GPU it is device work, and on this CPU
            # its megabytes would evict the next step's host data from the caches.
            w.table.gather = real_gather  # type: ignore[method-assign]
            counts = new.columns.num_pages(PAGE)
            bases = torch.from_numpy(w.table.flat_bases(new.columns.rows, counts))
            counts_t = torch.from_numpy(counts.astype("int32"))
            total = int(counts.sum())
            out = torch.empty(total, dtype=torch.int32)
            for _ in range(steps):
                t5 = time.process_time()
                w.table.gather(bases, counts_t, total, out=out)
                rows["gather"].append((time.process_time() - t5) * 1e3)
    after = [sum(x) for x in zip(rows["deltas"], rows["batch"], rows["attn"], strict=True)]
    return {"after": statistics.median(after)} | {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--mode", nargs="+", choices=["graph", "eager"], default=["graph", "eager"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--swa", action="store_true", help="two page tables (sliding layers)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    head = f"{'mode':6} {'batch':>5} {'context':>7} {'before':>9} {'after':>7} {'ratio':>7}"
    print(head + f" {'deltas':>7} {'batch()':>8} {'attn':>7} {'gather*':>8}   (ms, medians)")
    with flashinfer_on_the_host():
        for mode in args.mode:
            for b in args.batch:
                for c in args.context:
                    r = measure(b, c, args.steps, mode, args.swa)
                    ratio = r["before"] / r["after"]
                    print(
                        f"{mode:6} {b:5d} {c:7d} {r['before']:9.3f} {r['after']:7.3f}"
                        f" {ratio:6.1f}x {r['deltas']:7.3f} {r['batch']:8.3f} {r['attn']:7.3f}"
                        f" {r['gather']:8.3f}",
                        flush=True,
                    )
                    results.append({"mode": mode, "batch": b, "context": c, **r})
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=1))
    print("* gather: the device's work on a GPU (three queued kernels), timed here on the CPU")


if __name__ == "__main__":
    main()
