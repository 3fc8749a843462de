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

FP8 KV cache (``spec.kv_dtype`` float8_e4m3fn, --kv-cache-dtype fp8_e4m3):
planned with ``kv_data_type`` e4m3 and bf16/fp16 queries and output (FA2 and
the CUDA-core decode kernel convert the pages as they load them), ``store_kv``
quantizes with the layer's scales, ``run`` takes the layer's ``k_scale``
(FlashInfer folds it into sm_scale), and ``scale_output`` multiplies the output
by its ``v_scale`` (FlashInfer's own ``v_scale`` does the same unfused multiply;
ours is one op of ours, which the CPU harness captures like ``store_kv``).

Sliding window W (the query included) is FlashInfer's ``window_left = W - 1``;
the spec's scale is ``sm_scale`` and its soft cap ``logits_soft_cap`` (FlashInfer
caps the scaled scores: cap * tanh(scale * q.k / cap), as Gemma 2), both planned
once per wrapper. Sinks are refused: the FA2 modules drop them
(attention_choice.py).

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

CUDA graphs for drafted (speculative) steps, SGLang's "target_verify": after
``enable_decode_graphs``, ``enable_verify_graphs(rows_per_seq)`` gives each size
(sequences) a ``use_cuda_graph=True`` prefill wrapper over fixed qo_indptr /
indptr / indices / last_page_len buffers. Every sequence has exactly
``rows_per_seq`` query rows (ModelCompute pads a row that drafted fewer, its
extra rows writing the scratch page: ``cuda_graphs.pad_verify_batch``), so the
qo_indptr is uniform and the captured kernels' row count is fixed; sequences
past the batch are padding on the scratch page. ``verify_graphs`` is the
``GraphAttention`` DecodeGraphs drives.

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

from worker_service.attention.attention_choice import SINKS_UNSUPPORTED
from worker_service.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
)
from worker_service.attention.flashinfer_modules import TENSOR_CORE_DECODE_GROUP
from worker_service.attention.paged_layout import (
    check_token_order,
    gather_bases,
    kv_rows,
    paged_layout,
    pick_graph_size,
    scale_output,
    store_kv,
)
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable

# As SGLang: 1, 2, 4, then every 8 up to 256. A batch is padded by at most 7 rows
# (at most 3 below 8), so above batch 64 padding is under 10% of the rows replayed;
# powers of two padded batch 129 to 256. A size costs a capture at start and its
# output buffer (DecodeGraphs), its intermediates share one pool.
GRAPH_SIZE_STEP = 8
MAX_GRAPH_SIZE = 256
DEFAULT_GRAPH_SIZES = (1, 2, 4, *range(GRAPH_SIZE_STEP, MAX_GRAPH_SIZE + 1, GRAPH_SIZE_STEP))
# Drafted steps: the scheduler drafts only while at most 32 requests run
# (--speculative-disable-by-batch-size), so verify graphs stop there.
DEFAULT_VERIFY_SIZES = (1, 2, 4, 8, 16, 24, 32)
_INT32_MAX = 2**31 - 1


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
        workspace: torch.Tensor | None = None,
    ) -> None:
        """``workspace``: a float workspace shared with another backend whose
        kernels run on the same stream (layer groups), else one of its own."""
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
        # wide GQA groups, and the CUDA-core kernel only has groups 1,2,3,4,6,8,16;
        # the prebuilt modules follow the same rule (flashinfer_modules.py).
        wide = group >= TENSOR_CORE_DECODE_GROUP
        self._tensor_cores = wide if decode_tensor_cores is None else decode_tensor_cores
        # FlashInfer wants the float workspace zeroed before its first use.
        if workspace is None:
            workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.spec.device)
        self.workspace = workspace
        self._prefill_backend = prefill_backend
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend
        )
        self._decode = self._decode_wrapper()
        # FlashInfer copies each plan from pinned buffers it reuses without waiting;
        # a new plan waits on this event, recorded after the previous plan's copies.
        self._plan_done = CUDA.event()
        self._heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.page_size)
        self._plan_kw: dict[str, Any] = {
            "window_left": spec.sliding_window - 1 if spec.sliding_window else -1,
            "sm_scale": spec.scale,
            "logits_soft_cap": spec.logit_soft_cap,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.kv_cache_dtype,
            "non_blocking": True,
        }
        self._prefill_rows = 0  # query rows of this step's extends
        self._active_prefill: Any = self._prefill  # the prefill wrapper planned this step
        self._active_decode: Any = None  # the decode wrapper planned this step, if any
        self._rows_now = torch.empty(2, 0, dtype=torch.int64, device=self.spec.device)
        self._graphs: dict[int, Any] = {}
        self._verify: dict[int, Any] = {}
        self.verify_graphs: VerifyGraphs | None = None
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
            self.workspace, "NHD", backend="fa2", **kwargs
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
        self._active_prefill = self._prefill
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
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv: KvCache,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise ValueError(SINKS_UNSUPPORTED + "; use the torch attention backend")
        cache = kv.layers[layer]
        if cache.dtype != self.spec.kv_cache_dtype:
            raise ValueError(f"KV cache is {cache.dtype}, planned for {self.spec.kv_cache_dtype}")
        k_scale = v_scale = 1.0
        if kv.quantized:
            k_scale, v_scale = kv.scales.k[layer], kv.scales.v[layer]
        store_kv(cache, self._rows_now, k, v, scales=(k_scale, v_scale))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # FlashInfer folds k_scale into the kernel's sm_scale (a launch argument,
        # baked into a captured graph per layer); v_scale multiplies the output.
        run_kw = {"k_scale": k_scale} if kv.quantized else {}
        n = self._prefill_rows
        if n:
            self._active_prefill.run(q[:n], cache, out=out[:n], **run_kw)
        if self._active_decode is not None:
            self._active_decode.run(q[n:], cache, out=out[n:], **run_kw)
        if v_scale != 1.0:
            scale_output(out, v_scale)
        return out

    # ---- CUDA graphs for decode ---------------------------------------------------

    def enable_decode_graphs(
        self, scratch_page: int, max_pages_per_seq: int, sizes: Sequence[int] = DEFAULT_GRAPH_SIZES
    ) -> None:
        """One fixed-batch decode wrapper per size, all over shared fixed buffers (only
        one graph replays at a time, and its plan rewrites them just before)."""
        largest = max(sizes)
        self._scratch_page = scratch_page
        self._g_max_pages = max(max_pages_per_seq, 1)
        self._g_capacity = largest * self._g_max_pages
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

    # ---- CUDA graphs for drafted (verify) steps ----------------------------------------

    def enable_verify_graphs(
        self, rows_per_seq: int, sizes: Sequence[int] = DEFAULT_VERIFY_SIZES
    ) -> None:
        """One fixed-batch prefill wrapper per size (sequences of ``rows_per_seq``
        query rows each), over fixed buffers shared by the sizes; after
        ``enable_decode_graphs`` (its scratch page and page bound)."""
        if not self._graphs:
            raise RuntimeError("enable_decode_graphs first: verify graphs use its scratch page")
        q, largest = rows_per_seq, max(sizes)
        dev, i32 = self.spec.device, torch.int32
        self._v_rows_per_seq = q
        # Uniform: sequence i's rows are i*q .. i*q + q - 1, padding sequences included.
        self._v_qo = torch.arange(0, (largest + 1) * q, q, dtype=i32, device=dev)
        self._v_indptr = torch.zeros(largest + 1, dtype=i32, device=dev)
        self._v_last = torch.ones(largest, dtype=i32, device=dev)
        # A drafted row reads up to q positions past its KV length.
        self._v_capacity = largest * (self._g_max_pages + -(-q // self.spec.page_size))
        self._v_indices = torch.zeros(self._v_capacity, dtype=i32, device=dev)
        self._v_rows = torch.zeros(2, largest * q, dtype=torch.int64, device=dev)
        self._verify = {
            size: self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                backend=self._prefill_backend,
                use_cuda_graph=True,
                qo_indptr_buf=self._v_qo[: size + 1],
                paged_kv_indptr_buf=self._v_indptr[: size + 1],
                paged_kv_indices_buf=self._v_indices,
                paged_kv_last_page_len_buf=self._v_last[:size],
            )
            for size in sorted(set(sizes))
        }
        self.verify_graphs = VerifyGraphs(self, q, self._scratch_page)

    def verify_graph_size_for(self, batch: AttentionBatch) -> int | None:
        """Smallest verify size that holds ``batch``: every sequence an extend of
        exactly ``rows_per_seq`` rows (padded by the caller), pages within bounds."""
        q, cols = self._v_rows_per_seq, batch.columns
        n = len(cols)
        size = pick_graph_size(n, tuple(self._verify))
        if size is None or batch.num_extends != n or (cols.q_lens != q).any():
            return None
        ps = self.spec.page_size
        pages = int(cols.num_pages(ps).sum()) + (size - n) * -(-q // ps)
        return size if pages <= self._v_capacity else None

    def begin_verify_graph_step(self, batch: AttentionBatch, size: int) -> None:
        """Plan the size-``size`` verify wrapper for ``batch`` plus padding
        sequences on the scratch page, and rewrite the fixed buffers (outside the
        graph, as begin_graph_step).

        A padded sequence (``cuda_graphs.pad_verify_batch``) reads its row's pages
        as far as the row holds them, then the scratch page for the positions its
        padding rows added past them: the real pages are gathered on the device
        into one run, then spread to their places in the flat indices, whose other
        entries are the scratch page (O(batch) host work, as begin_graph_step)."""
        q, cols = self._v_rows_per_seq, batch.columns
        n = len(cols)
        if (
            batch.num_extends != n
            or n > size
            or size not in self._verify
            or (cols.q_lens != q).any()
        ):
            raise ValueError(f"not a batch of {q}-row extends that fits verify size {size}")
        check_token_order(batch)
        self._plan_done.synchronize()
        ps, scratch = self.spec.page_size, self._scratch_page
        pad_pages = -(-q // ps)
        needed = cols.num_pages(ps).astype(np.int32)
        real = np.minimum(batch.pages.lengths[cols.rows], needed).astype(np.int32)
        qo_indptr = np.arange(0, (size + 1) * q, q, dtype=np.int32)
        counts = np.concatenate([needed, np.full(size - n, pad_pages, np.int32)])
        kv_indptr = np.zeros(size + 1, np.int32)
        np.cumsum(counts, out=kv_indptr[1:])
        kv_lens = np.concatenate([cols.kv_lens, np.full(size - n, q, np.int64)])
        last = (kv_lens - (counts.astype(np.int64) - 1) * ps).astype(np.int32)
        bases = batch.pages.flat_bases(cols.rows, real)
        # Where sequence i's gathered pages go: its own start in the padded layout.
        shift = (kv_indptr[:n] - (np.cumsum(real) - real)).astype(np.int32)
        host_rows, dev_rows = self._rows(batch)
        arrays = [qo_indptr, kv_indptr, last, bases, real, shift]
        host, dev = _stage(arrays + ([] if host_rows is None else [host_rows]), self.spec.device)
        total_real, total = int(real.sum()), int(kv_indptr[-1])
        indices = self._spread_pages(
            batch.pages, dev[3], dev[4], dev[5], total_real=total_real, total=total
        )
        kw = self._plan_kw
        self._verify[size].plan(host[0], host[1], indices, host[2], *self._heads, causal=True, **kw)
        rows = self._v_rows[:, : size * q]
        # Padding sequences store their K/V in slot 0 of the scratch page.
        rows[0].fill_(scratch * 2 * ps)
        rows[1].fill_(scratch * 2 * ps + ps)
        if n:
            rows[:, : n * q].copy_(dev_rows if host_rows is None else dev[6].view(2, n * q))
        self._rows_now = rows
        self._prefill_rows = size * q
        self._active_prefill = self._verify[size]
        self._active_decode = None
        self._plan_done.record()

    def _spread_pages(
        self,
        table: PageTable,
        bases: torch.Tensor,
        real: torch.Tensor,
        shift: torch.Tensor,
        *,
        total_real: int,
        total: int,
    ) -> torch.Tensor:
        """``total`` flat indices: the scratch page, but for each sequence's ``real``
        pages gathered from its row and moved by its ``shift`` (device ops)."""
        gathered = table.gather(
            bases, real, total_real, out=CUDA.empty(total_real, torch.int32, self.spec.device)
        )
        if self._indices.shape[0] < total:
            self._indices = CUDA.empty(total, torch.int32, self.spec.device)
        out = self._indices[:total]
        out.fill_(self._scratch_page)
        if total_real:
            dest = torch.repeat_interleave(shift, real, output_size=total_real).long()
            dest += torch.arange(total_real, dtype=torch.long, device=dest.device)
            out.index_copy_(0, dest, gathered)
        return out


@dataclass(frozen=True)
class VerifyGraphs:
    """The ``GraphAttention`` of drafted steps (cuda_graphs.DecodeGraphs with
    ``rows_per_seq``): FlashInferAttention's verify wrappers."""

    attention: FlashInferAttention
    rows_per_seq: int
    scratch_page: int

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return tuple(self.attention._verify)

    def graph_size_for(self, batch: AttentionBatch) -> int | None:
        return self.attention.verify_graph_size_for(batch)

    def begin_graph_step(self, batch: AttentionBatch, size: int) -> None:
        self.attention.begin_verify_graph_step(batch, size)
