"""FlashInfer attention for CUDA workers (fp16/bf16: FlashInfer has no fp32 kernels).

``begin_step`` builds FlashInfer's CSR page layout of the extends and of the
decodes: indptr and last_page_len on the host from the batch's O(batch)
columns (FlashInfer's ``plan`` reads them there), the flat page indices on the
device, gathered from the rows of the worker's page table
(``PageTable.gather``: no page list is read on the host); the host's arrays go
up in one pinned non-blocking copy, so it never waits on the GPU; and it
plans ``BatchPrefillWithPagedKVCacheWrapper`` (ragged queries, paged KV,
causal) and ``BatchDecodeWithPagedKVCacheWrapper`` once each; a layer's
``forward`` only writes its K/V and runs the planned kernels. Both wrappers
share one float workspace: they run one after the other on one stream.
Kernels: FA2 for prefill (FA3 takes ~40 min per module to build on our 2-core
machines; ``prefill_backend="fa3"`` needs a bundle built with it), and for
decode FlashInfer's CUDA-core kernel or, for GQA groups >= 4, the FA2 prefill
kernel on tensor cores (the same module as prefill).

KV write: ``index_copy_`` into the cache viewed as rows (pages * 2 * page_size,
kv_heads, head_dim): it needs only each token's (page, offset), is capturable,
and adds no kernel module to the prebuilt bundle (``append_paged_kv_cache``
would also need each token's batch index and position on the device).

Sliding window W (the query included) is FlashInfer's ``window_left = W - 1``.

CUDA graphs for decode (glue: ``worker_service.execution.cuda_graphs.DecodeGraphs``):
1. Give the KvCache one spare page the scheduler never hands out (allocate
   num_pages + 1, keep the last) and call ``enable_decode_graphs(scratch_page,
   max_pages_per_seq)``: padded rows write their K/V there and read only it.
   Each size gets a ``use_cuda_graph=True`` decode wrapper (FlashInfer fixes
   its batch size) over fixed indptr / indices / last_page_len buffers.
2. ``DecodeGraphs.capture()``: per size ``begin_graph_step(empty batch, size)``
   (plans outside the graph, as FlashInfer requires), warm-up, capture.
3. Decode-only steps: ``DecodeGraphs.replay(batch, inputs)`` copies inputs,
   calls ``begin_graph_step`` (re-plan: the indices gathered from the page table
   plus the padding rows' scratch page, which ``plan`` copies device to device
   into the fixed buffer) and replays;
   None means no captured size fits (too many sequences or pages): run eager.

FlashInfer copies plans from pinned buffers it reuses without waiting, so a
new plan first waits for the previous plan's copies (not its kernels): the
runner may run one step ahead of the GPU, not two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker_service.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
    SeqColumns,
)
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_INT32_MAX = 2**31 - 1


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


def store_kv(cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Same result as ``KvCache.write``; ``rows`` is (2, T): key rows, value rows."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    flat.index_copy_(0, rows[0], k.to(cache.dtype))
    flat.index_copy_(0, rows[1], v.to(cache.dtype))


class CudaFacilities:
    """The CUDA-only calls this backend makes, in one place: the CPU conformance test
    (tests/worker_service/test_flashinfer_conformance.py) swaps ``CUDA`` below for a
    stand-in and drives everything else through FlashInfer's real wrappers. Production
    always uses this class; its methods are exactly the calls they replace."""

    def usable(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def on_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory()

    def to_device(self, pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
        return pinned.to(device, non_blocking=True)

    def event(self) -> Any:
        return torch.cuda.Event()

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of the backend's own on the device."""
        return torch.empty(n, dtype=dtype, device=device)


CUDA = CudaFacilities()


def _stage(arrays: list[np.ndarray], device: torch.device) -> tuple[list, list]:
    """One pinned int32 tensor, one copy to ``device``: host and device views of each."""
    packed = CUDA.pin(torch.from_numpy(np.concatenate(arrays)))
    on_device = CUDA.to_device(packed, device)
    sizes = [int(a.shape[0]) for a in arrays]
    return list(packed.split(sizes)), list(on_device.split(sizes))


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        workspace_bytes: int = 256 * 2**20,
        prefill_backend: str = "fa2",
        decode_tensor_cores: bool | None = None,
    ) -> None:
        super().__init__(spec)
        if spec.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"FlashInfer has fp16/bf16 attention kernels only, not {spec.dtype}: "
                "run the model in bf16/fp16 or use the 'torch' backend"
            )
        if not CUDA.usable(spec.device):
            raise RuntimeError(
                "the 'flashinfer' attention backend needs a CUDA GPU; use 'torch' on CPU"
            )
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        try:  # imported here so the package imports on machines without flashinfer
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(
                "flashinfer is not importable: pip install 'radixserve[gpu]', or put "
                ".fi_bundle on PYTHONPATH (scripts/build_flashinfer_bundle.sh)"
            ) from exc
        self._fi = flashinfer
        group = spec.num_heads // spec.num_kv_heads
        # Tensor-core decode (FlashInfer's prefill kernel on q_len 1) pays off for
        # wide GQA groups, and the CUDA-core kernel only has groups 1,2,3,4,6,8,16.
        self._tensor_cores = group >= 4 if decode_tensor_cores is None else decode_tensor_cores
        # FlashInfer wants the float workspace zeroed before its first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.spec.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=prefill_backend
        )
        self._decode = self._decode_wrapper()
        # FlashInfer copies each plan from pinned buffers it reuses without waiting;
        # a new plan waits on this event, recorded after the previous plan's copies.
        self._plan_done = CUDA.event()
        self._heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.page_size)
        self._plan_kw: dict[str, Any] = {
            "window_left": spec.sliding_window - 1 if spec.sliding_window else -1,
            "sm_scale": spec.scale,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.dtype,
            "non_blocking": True,
        }
        self._prefill_rows = 0  # query rows of this step's extends
        self._active_decode: Any = None  # the decode wrapper planned this step, if any
        self._rows_now = torch.empty(2, 0, dtype=torch.int64, device=self.spec.device)
        self._graphs: dict[int, Any] = {}
        # The step's flat page indices, gathered here from the page table; a
        # step's gather is stream-ordered after the kernels of the step before.
        self._indices = CUDA.empty(0, torch.int32, spec.device)

    def _decode_wrapper(self, graph_size: int = 0) -> Any:
        kwargs: dict[str, Any] = {"use_tensor_cores": self._tensor_cores}
        if graph_size:
            kwargs |= {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": self._g_indptr[: graph_size + 1],
                "paged_kv_indices_buffer": self._g_indices,
                "paged_kv_last_page_len_buffer": self._g_last[:graph_size],
            }
        # "fa2" explicitly: "auto" may route to cuDNN, which the bundle does not carry.
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2", **kwargs
        )

    def _rows(self, batch: AttentionBatch) -> tuple[np.ndarray | None, torch.Tensor | None]:
        """Key and value rows of the batch's tokens, on the host (int32) if given there."""
        ps = self.spec.page_size
        k = kv_rows(batch.write_pages, batch.write_offsets, ps)
        if not CUDA.on_host(batch.write_pages):
            return None, torch.stack([k, k + ps]).to(self.spec.device, torch.int64)
        both = torch.cat([k, k + ps]).numpy()
        if both.size and both.max() > _INT32_MAX:
            raise ValueError("KV cache too large for int32 row indices")
        return both.astype(np.int32), None

    def _page_indices(
        self,
        table: PageTable,
        bases: torch.Tensor,
        counts: torch.Tensor,
        total: int,
        *,
        pad: int = 0,
    ) -> torch.Tensor:
        """The sequences' flat page indices gathered on the device from the page
        table, then ``pad`` entries of the scratch page (graph padding rows)."""
        if self._indices.shape[0] < total + pad:
            self._indices = CUDA.empty(
                max(total + pad, 2 * self._indices.shape[0]), torch.int32, self.spec.device
            )
        table.gather(bases, counts, total, out=self._indices)
        if pad:
            self._indices[total : total + pad].fill_(self._scratch_page)
        return self._indices[: total + pad]

    def begin_step(self, batch: AttentionBatch) -> None:
        check_token_order(batch)
        self._plan_done.synchronize()
        ps, e, cols = self.spec.page_size, batch.num_extends, batch.columns
        ext, dec = paged_layout(cols[:e], ps), paged_layout(cols[e:], ps)
        counts = np.concatenate([ext.counts, dec.counts])
        bases = gather_bases(batch.pages, cols, counts)
        host_rows, dev_rows = self._rows(batch)
        arrays = [ext.qo_indptr, ext.kv_indptr, ext.last_page_len]
        arrays += [dec.kv_indptr, dec.last_page_len, bases, counts]
        host, dev = _stage(arrays + ([] if host_rows is None else [host_rows]), self.spec.device)
        self._rows_now = dev_rows if host_rows is None else dev[7].view(2, -1).long()
        self._prefill_rows = int(ext.qo_indptr[-1])
        ext_pages, total = int(ext.kv_indptr[-1]), int(counts.sum())
        indices = self._page_indices(batch.pages, dev[5], dev[6], total)
        if e:
            kw = self._plan_kw
            ext_indices = indices[:ext_pages]
            self._prefill.plan(
                host[0], host[1], ext_indices, host[2], *self._heads, causal=True, **kw
            )
        self._active_decode = self._decode if len(batch.seqs) > e else None
        if self._active_decode is not None:
            self._decode.plan(host[3], indices[ext_pages:], host[4], *self._heads, **self._plan_kw)
        self._plan_done.record()

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kv: KvCache
    ) -> torch.Tensor:
        cache = kv.layers[layer]
        if cache.dtype != self.spec.dtype:
            raise ValueError(f"KV cache is {cache.dtype}, planned for {self.spec.dtype}")
        store_kv(cache, self._rows_now, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = self._prefill_rows
        if n:
            self._prefill.run(q[:n], cache, out=out[:n])
        if self._active_decode is not None:
            self._active_decode.run(q[n:], cache, out=out[n:])
        return out

    # ---- CUDA graphs for decode ---------------------------------------------------

    def enable_decode_graphs(
        self, scratch_page: int, max_pages_per_seq: int, sizes: Sequence[int] = DEFAULT_GRAPH_SIZES
    ) -> None:
        """One fixed-batch decode wrapper per size, all over shared fixed buffers (only
        one graph replays at a time, and its plan rewrites them just before)."""
        largest = max(sizes)
        self._scratch_page = scratch_page
        self._g_capacity = largest * max(max_pages_per_seq, 1)
        dev, i32 = self.spec.device, torch.int32
        self._g_indptr = torch.zeros(largest + 1, dtype=i32, device=dev)
        self._g_last = torch.ones(largest, dtype=i32, device=dev)
        self._g_indices = torch.zeros(self._g_capacity, dtype=i32, device=dev)
        self._g_rows = torch.zeros(2, largest, dtype=torch.int64, device=dev)
        self._graphs = {size: self._decode_wrapper(size) for size in sorted(set(sizes))}

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return tuple(self._graphs)

    def graph_size_for(self, batch: AttentionBatch) -> int | None:
        """Smallest captured size that holds this decode-only batch, else None."""
        n = len(batch.columns)
        size = pick_graph_size(n, self.graph_sizes)
        if batch.num_extends or size is None:
            return None
        pages = int(batch.columns.num_pages(self.spec.page_size).sum()) + (size - n)
        return size if pages <= self._g_capacity else None

    def begin_graph_step(self, batch: AttentionBatch, size: int) -> None:
        """Plan the size-``size`` graph wrapper for ``batch`` padded to ``size`` and
        rewrite the fixed buffers the captured kernels read (outside the graph)."""
        if batch.num_extends or len(batch.seqs) > size or size not in self._graphs:
            raise ValueError(f"not a decode batch that fits graph size {size}")
        check_token_order(batch)
        self._plan_done.synchronize()
        ps, cols, n = self.spec.page_size, batch.columns, len(batch.columns)
        lay = paged_layout(cols, ps, pad_to=size)
        bases = gather_bases(batch.pages, cols, lay.counts)
        host_rows, dev_rows = self._rows(batch)
        arrays = [lay.kv_indptr, lay.last_page_len, bases, lay.counts]
        host, dev = _stage(arrays + ([] if host_rows is None else [host_rows]), self.spec.device)
        real = int(lay.kv_indptr[n])
        indices = self._page_indices(batch.pages, dev[2], dev[3], real, pad=size - n)
        self._graphs[size].plan(host[0], indices, host[1], *self._heads, **self._plan_kw)
        rows = self._g_rows[:, :size]
        # Padded tokens store their K/V in slot 0 of the scratch page.
        rows[0].fill_(self._scratch_page * 2 * ps)
        rows[1].fill_(self._scratch_page * 2 * ps + ps)
        if n:
            rows[:, :n].copy_(dev_rows if host_rows is None else dev[4].view(2, n))
        self._rows_now = rows
        self._prefill_rows = 0
        self._active_decode = self._graphs[size]
        self._plan_done.record()
