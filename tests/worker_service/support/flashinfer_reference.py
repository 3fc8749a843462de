"""Reference implementations, in torch on the CPU, of the compiled FlashInfer modules
that ``BatchPrefillWithPagedKVCacheWrapper`` and ``BatchDecodeWithPagedKVCacheWrapper``
(flashinfer-python 0.7.2.post1, FA2 backend) call, so that the wrappers' own Python
runs unchanged on a machine without a GPU (tests/worker_service/support/flashinfer_cpu_harness.py
installs them).

Each entry point takes the positional arguments of the real one (its C++ signature
in the package's data/csrc/batch_prefill.cu, batch_prefill_paged.cuh and
batch_decode.cu) and reads them by position and meaning, the way the kernel does:
index arrays as the module's index type, the paged cache through the layout code,
heads and page size from the cache's shape, queries through their strides, the
output as a dense (rows, heads, head_dim) array. What the kernel would reject
(TVM_FFI_ICHECK), or would turn into out-of-bounds reads or silently wrong tiles,
raises ``KernelContractError`` here instead.

Plan and run meet the way they do in FlashInfer: ``plan`` writes its record (the
host qo/kv indptr it was given) through the page-locked buffer into the int
workspace and returns a plan-info vector of plain ints; ``run`` reads the record
back from the int workspace at the offset that vector names. A CUDA graph bakes
in the plan-info vector and the tensor addresses and re-reads the workspace and
the index buffers at every replay, and so does ``GraphTape`` below.

Math (float32, FlashInfer's documented semantics): query row t of a request with
``qo_len`` rows and ``kv_len`` keys sits at position ``p = kv_len - qo_len + t``;
causal masking keeps keys ``j <= p``; a sliding window (modules built with
``use_sliding_window``, ``window_left >= 0``) keeps ``j >= p - window_left``, i.e.
``window_left + 1`` keys including the query's own (include/flashinfer/attention/
variants.cuh); query head h reads key/value head ``h // (num_qo_heads //
num_kv_heads)``; logits are scaled by ``sm_scale`` before the softmax; a module
built with ``use_logits_soft_cap`` caps the scaled logits, ``cap * tanh(logits /
cap)`` with the run's ``logits_soft_cap`` (variants.cuh: LogitsTransform), and one
built without it ignores the value. The FA2 modules take no sinks: FlashInfer's
Python drops a wrapper's ``sinks`` before calling them (prefill.py's paged_run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# FlashInfer's enum values (flashinfer/utils.py: MaskMode, TensorLayout, PosEncodingMode).
MASK_NON_CAUSAL, MASK_CAUSAL = 0, 1
LAYOUT_NHD, LAYOUT_HND = 0, 1
POS_ENCODING_NONE = 0
# GQA group sizes the CUDA-core decode kernel is instantiated for
# (DISPATCH_GQA_GROUP_SIZE in data/include/flashinfer/utils.cuh).
DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)

_PREFILL_TAG, _DECODE_TAG = 0x5046, 0x4446  # marks a record as planned by which module
_HEADER = 10  # int32 fields before a record's arrays


class KernelContractError(RuntimeError):
    """The arguments would make the real kernel fail a check, read memory it should
    not, or compute over tiles planned for different data."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelContractError(message)


# ---- where tensors live ---------------------------------------------------------------


class Placement:
    """Which CPU tensors stand for GPU memory and which for pinned host memory.

    On a CPU-only machine both are CPU tensors; the CPU stand-in for the backend's
    CUDA facilities registers what it "copies to the device" and what it "pins",
    and the reference checks that FlashInfer never reads device memory on the host
    (a hidden GPU synchronisation every step). Registered tensors are kept alive so
    their storage addresses stay unique for the test's lifetime."""

    def __init__(self) -> None:
        self._device: dict[int, torch.Tensor] = {}
        self._pinned: dict[int, torch.Tensor] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()  # 0 for empty tensors: never registered

    def mark_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._key(t):
            self._device[self._key(t)] = t
        return t

    def mark_pinned(self, t: torch.Tensor) -> torch.Tensor:
        if self._key(t):
            self._pinned[self._key(t)] = t
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return self._key(t) in self._device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self._key(t) in self._pinned

    def require_device(self, what: str, t: torch.Tensor) -> None:
        _require(
            self.is_device(t),
            f"{what} is host memory where FlashInfer copies it with non_blocking=False: "
            "the host waits for the GPU",
        )

    def require_pinned_or_device(self, what: str, t: torch.Tensor) -> None:
        _require(
            self.is_device(t) or self.is_pinned(t),
            f"{what} is pageable host memory: its non_blocking copy to the GPU is synchronous",
        )

    def require_host(self, what: str, t: torch.Tensor) -> None:
        _require(
            not self.is_device(t),
            f"{what} is device memory but FlashInfer reads it on the host: "
            "a device-to-host copy that waits for the GPU at every plan",
        )


PLACEMENT = Placement()  # the harness replaces it per test


# ---- CUDA-graph stand-in ----------------------------------------------------------------


class GraphTape:
    """Kernel launches are recorded, not run, while a (stand-in) CUDA graph captures;
    a replay runs them again with the very argument objects of the capture, which
    read whatever the tensors hold at replay time: what a real graph does."""

    def __init__(self) -> None:
        self._recording: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None

    def launch(self, kernel: Callable[..., Any], *args: Any) -> None:
        if self._recording is None:
            kernel(*args)
        else:
            self._recording.append((kernel, args))

    def start(self) -> None:
        _require(self._recording is None, "graph captures do not nest")
        self._recording = []

    def stop(self) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        recorded, self._recording = self._recording or [], None
        return recorded

    @property
    def capturing(self) -> bool:
        return self._recording is not None


TAPE = GraphTape()
CALLS: Counter[str] = Counter()  # entry point -> calls, so tests can see which kernels ran


# ---- the math -----------------------------------------------------------------------------


def paged_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: int,
    pages: torch.Tensor,
    kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (kv_len, kv_heads, head_dim) of one request, read from its
    pages as the kernel does: NHD pages are (page_size, heads, dim), HND ones
    (heads, page_size, dim)."""
    k, v = k_cache[pages.long()], v_cache[pages.long()]
    if layout == LAYOUT_HND:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    heads, dim = k.shape[-2], k.shape[-1]
    return k.reshape(-1, heads, dim)[:kv_len], v.reshape(-1, heads, dim)[:kv_len]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window_left: int,
    sm_scale: float,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """One request: q (qo_len, qo_heads, D), k/v (kv_len, kv_heads, D) -> (qo_len, qo_heads, D),
    float32. ``window_left < 0`` means no window; ``soft_cap`` 0: no cap."""
    qo_len, kv_len = q.shape[0], k.shape[0]
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    qf = q.float().view(qo_len, kv_heads, group, -1)
    logits = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * sm_scale
    if soft_cap > 0:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    pos = torch.arange(kv_len - qo_len, kv_len)[:, None]
    key = torch.arange(kv_len)[None, :]
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        keep &= key <= pos
    if window_left >= 0:
        keep &= key >= pos - window_left
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    probs = torch.nan_to_num(probs)  # a row with no key writes zeros, as the kernel does
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(qo_len, kv_heads * group, -1)


# ---- what a module is compiled for ---------------------------------------------------------


@dataclass(frozen=True)
class Specialization:
    """The JIT arguments a module is built for (get_batch_prefill_uri / get_batch_decode_uri)."""

    dtype_q: torch.dtype
    dtype_kv: torch.dtype
    dtype_o: torch.dtype
    dtype_idx: torch.dtype
    head_dim_qk: int
    head_dim_vo: int
    pos_encoding_mode: int
    use_sliding_window: bool
    use_logits_soft_cap: bool

    def soft_cap(self, logits_soft_cap: float) -> float:
        """The cap the kernel applies: the run's value in a soft-cap module (which
        divides by it: 0 there is a division by zero), none elsewhere."""
        if not self.use_logits_soft_cap:
            return 0.0
        _require(logits_soft_cap > 0, "a soft-cap module run with logits_soft_cap <= 0")
        return logits_soft_cap

    def check_supported(self) -> None:
        _require(self.pos_encoding_mode == POS_ENCODING_NONE, "only pos_encoding NONE is modelled")
        _require(self.head_dim_qk == self.head_dim_vo, "only head_dim_qk == head_dim_vo modelled")

    def check_index(self, **arrays: torch.Tensor) -> None:
        """The kernel reinterprets every index array as the module's IdType."""
        for name, a in arrays.items():
            _require(
                a.dtype == self.dtype_idx,
                f"{name} is {a.dtype}; the module is compiled for {self.dtype_idx} indices",
            )
            _require(a.dim() == 1 and a.is_contiguous(), f"{name} must be a dense 1-D array")

    def check_data(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor
    ) -> None:
        _require(q.dtype == self.dtype_q, f"q is {q.dtype}, module built for {self.dtype_q}")
        _require(k.dtype == v.dtype == self.dtype_kv, f"kv is {k.dtype}, not {self.dtype_kv}")
        _require(o.dtype == self.dtype_o, f"o is {o.dtype}, module built for {self.dtype_o}")
        _require(q.dim() == 3 and q.shape[2] == self.head_dim_qk, "q is not (rows, heads, dim)")
        _require(q.stride(2) == 1, "q's last dimension must be contiguous")
        # The output is written at o + row * heads * dim + head * dim (prefill.cuh).
        _require(o.shape == q.shape and o.is_contiguous(), "o must be dense like q")
        _require(k.stride() == v.stride(), "K and V caches must have identical strides")
        _require(k.dim() == 4 and k.shape[3] == self.head_dim_qk, "kv cache is not 4-D pages")


def _cache_geometry(k_cache: torch.Tensor, layout: int) -> tuple[int, int]:
    """(num_kv_heads, page_size) as the kernel derives them from the cache's shape."""
    _require(layout in (LAYOUT_NHD, LAYOUT_HND), f"unknown layout code {layout}")
    if layout == LAYOUT_HND:
        return k_cache.shape[1], k_cache.shape[2]
    return k_cache.shape[2], k_cache.shape[1]


# ---- plan records in the int workspace -------------------------------------------------------


@dataclass
class PlanRecord:
    tag: int
    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    qo_indptr: list[int]  # (batch + 1) query rows per request
    kv_indptr: list[int]  # (batch + 1) pages per request

    def encode(self) -> torch.Tensor:
        header = [self.tag, self.batch_size, self.num_qo_heads, self.num_kv_heads]
        header += [self.page_size, self.head_dim]
        header += [0] * (_HEADER - len(header))
        return torch.tensor(header + self.qo_indptr + self.kv_indptr, dtype=torch.int32)

    @classmethod
    def decode(cls, words: torch.Tensor) -> PlanRecord:
        h = words[:_HEADER].tolist()
        b = h[1]
        body = words[_HEADER : _HEADER + 2 * (b + 1)].tolist()
        return cls(h[0], b, h[2], h[3], h[4], h[5], body[: b + 1], body[b + 1 :])


def _write_plan(
    int_workspace: torch.Tensor, page_locked: torch.Tensor, record: PlanRecord, graph: bool
) -> list[int]:
    """Stage the record in the page-locked buffer, copy it into the int workspace
    (FlashInfer's cudaMemcpyAsync) and return the plan-info vector: [offset in
    int32 words, words, enable_cuda_graph]. Offset 0 for every plan of a wrapper,
    as FlashInfer keeps offsets fixed so that a captured graph stays valid."""
    words = record.encode()
    n = words.numel()
    page_locked.view(torch.int32)[:n].copy_(words)
    int_workspace.view(torch.int32)[:n].copy_(page_locked.view(torch.int32)[:n])
    return [0, n, int(graph)]


def _read_plan(int_workspace: torch.Tensor, plan_info: Sequence[int], tag: int) -> PlanRecord:
    _require(len(plan_info) == 3, f"plan_info {list(plan_info)} was not made by this module")
    offset, n, _ = plan_info
    record = PlanRecord.decode(int_workspace.view(torch.int32)[offset : offset + n])
    _require(record.tag == tag, "plan_info comes from another module's plan")
    return record


def _check_against_plan(
    record: PlanRecord,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
) -> None:
    """The tiles were planned for the host arrays; the kernel walks the device ones."""
    _require(
        (num_qo_heads, num_kv_heads, page_size)
        == (record.num_qo_heads, record.num_kv_heads, record.page_size),
        f"run sees heads/page_size {(num_qo_heads, num_kv_heads, page_size)}, planned "
        f"{(record.num_qo_heads, record.num_kv_heads, record.page_size)}",
    )
    _require(kv_indptr.numel() == record.batch_size + 1, "batch size differs from the plan")
    _require(qo_indptr.tolist() == record.qo_indptr, "qo_indptr differs from the planned one")
    _require(kv_indptr.tolist() == record.kv_indptr, "kv_indptr differs from the planned one")


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: int,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    o: torch.Tensor,
    causal: bool,
    window_left: int,
    sm_scale: float,
    soft_cap: float,
) -> None:
    """The work shared by the prefill and decode kernels, into ``o``; ``soft_cap``
    0: none."""
    num_pages = k_cache.shape[0]
    page_size = _cache_geometry(k_cache, layout)[1]
    qo, kv, last = qo_indptr.tolist(), kv_indptr.tolist(), last_page_len.tolist()
    _require(kv[0] == 0 and qo[0] == 0, "indptr arrays must start at 0")
    _require(kv[-1] <= kv_indices.numel(), "kv_indptr points past kv_indices")
    for i in range(len(kv) - 1):
        pages = kv_indices[kv[i] : kv[i + 1]]
        # A last page longer than a page reads the next slots in memory (in our
        # cache layout: the page's values as keys); 0 is a valid, shorter sequence.
        _require(0 <= last[i] <= page_size, f"last_page_len[{i}] = {last[i]} > page_size")
        _require(
            pages.numel() == 0 or (int(pages.min()) >= 0 and int(pages.max()) < num_pages),
            f"request {i} reads a page outside the cache",
        )
        kv_len = max(pages.numel() - 1, 0) * page_size + (last[i] if pages.numel() else 0)
        rows = slice(qo[i], qo[i + 1])
        k, v = paged_kv(k_cache, v_cache, layout, pages, kv_len)
        out = attend(q[rows], k, v, causal, window_left, sm_scale, soft_cap)
        o[rows] = out.to(o.dtype)


# ---- the modules ----------------------------------------------------------------------------
