"""The CPU decode-attention kernel (cpu_kernels/paged_decode.c): built with the
host's C compiler on first use, cached (kernels/c_build.py), and called
through ctypes.

It reads every decode row's keys and values where they lie in the page pool,
instead of gathering them into a padded batch first and handing that to
torch's attention. Built for the machine it runs on (-march=native), so the
cache key includes the CPU's feature flags and the compiler's version, and a
build never runs on a CPU it was not made for. Where there is no compiler
or the build fails, ``load_paged_decode`` returns None and attention stays on
the torch path.

Threads: where torch runs on OpenMP (its CPU builds do), the kernel is built
with -fopenmp and splits its tasks in C over torch's own pool: the library's
libgomp.so.1 resolves to the copy torch already loaded, so there is one pool,
and its threads, awake between the matmuls, take attention at once. (A
Python pool of our own competed with those spinning threads for the same
cores: 2.2-2.7x slower attention at 16 rows on 2 cores, docs/benchmarks.md.)
Elsewhere a Python thread pool splits the tasks (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_service.kernels.c_build import (
    CFLAGS,
    build_library,
    build_threaded,
    one_openmp_runtime,
)

logger = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "cpu_kernels" / "paged_decode.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Pages it reads besides those: an fp8 e4m3 cache (--kv-cache-dtype fp8_e4m3).
CACHE_DTYPE_CODES = DTYPE_CODES | {torch.float8_e4m3fn: 2}
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # as in the C source

_I64P = ctypes.POINTER(ctypes.c_int64)
_I32P = ctypes.POINTER(ctypes.c_int32)


def build(
    group: int, head_dim: int, directory: Path | None = None, *, openmp: bool = False
) -> Path:
    """Compile the kernel with a fast copy for ``group`` query heads per kv
    head and ``head_dim`` (or find it already built); return the library's
    path. ``openmp``: with OpenMP threads where they build (module
    docstring; ``c_build.build_threaded``). Raises
    RuntimeError when there is no compiler or the build fails."""
    flags = [*CFLAGS]
    if head_dim % 16 == 0:
        flags += [f"-DGROUP={group}", f"-DCHUNKS={head_dim // 16}"]
    stem = f"paged_decode-g{group}-d{head_dim}"
    if openmp:
        return build_threaded(SOURCE, flags, stem, directory)
    return build_library(SOURCE, flags, stem, directory)


_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_int,
    ctypes.c_void_p,  # cache
    ctypes.c_int,
    ctypes.c_void_p,  # out
    _I64P,  # rows
    _I64P,  # lens
    _I64P,  # indptr (each row's first cell in page_ids)
    _I32P,  # page_ids (the page table, read in place)
    ctypes.c_int,  # page_size
    ctypes.c_int,  # heads
    ctypes.c_int,  # kv_heads
    ctypes.c_int,  # head_dim
    ctypes.c_int,  # window
    ctypes.c_float,  # scale
    ctypes.c_float,  # soft_cap (0: none)
    ctypes.c_float,  # v_scale
    ctypes.c_void_p,  # sinks: (heads,) float32, or NULL
    ctypes.c_int64,  # task_begin (paged_decode_parallel: tasks)
    ctypes.c_int64,  # task_end (paged_decode_parallel: threads, an int)
]


# paged_decode_piece's arguments after paged_decode's up to sinks
_PIECE_ARGTYPES = [
    ctypes.c_int64,  # seq
    ctypes.c_int,  # phase
    ctypes.c_int,  # part
    ctypes.c_int,  # parts
    ctypes.c_void_p,  # scratch
]


class PagedDecodeKernel:
    """Decode attention for the torch backend on CPU. ``threads`` > 1 splits the
    (row, kv head) tasks: over OpenMP threads in C where the library was built
    with them, else over a Python pool (ctypes releases the GIL during a call)."""

    def __init__(self, library: Path, threads: int = 1) -> None:
        lib = ctypes.CDLL(str(library))
        fn = lib.paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGTYPES
        self._fn = fn
        # one row's attention in pieces over a team, and its scratch size (in
        # floats): the decode chain's team calls them from C
        self.piece = lib.paged_decode_piece
        self.piece.restype = ctypes.c_int
        self.piece.argtypes = [*_ARGTYPES[:-2], *_PIECE_ARGTYPES]
        self.piece_floats = lib.paged_decode_piece_floats
        self.piece_floats.restype = ctypes.c_int64
        self.piece_floats.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        self.library = library
        self.threads = max(1, threads)
        self.openmp = bool(lib.paged_decode_openmp())
        self._parallel = None
        if self.openmp:
            par = lib.paged_decode_parallel
            par.restype = ctypes.c_int
            par.argtypes = [*_ARGTYPES[:-1], ctypes.c_int]
            self._parallel = par
        self._pool = None
        if self.threads > 1 and not self.openmp:
            self._pool = ThreadPoolExecutor(self.threads - 1)

    @staticmethod
    def supports(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
        """The shapes and dtypes the kernel handles (its C side refuses others)."""
        group, rest = divmod(heads, kv_heads)
        return (
            dtype in DTYPE_CODES
            and rest == 0
            and 1 <= group <= MAX_GROUP
            and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        out: torch.Tensor,
        *,
        layout: DecodeLayout,
        window: int | None,
        scale: float,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Attention of the decode rows ``layout.rows`` of q (T, heads, D) over
        one layer's cache (pages, 2, page_size, kv_heads, D), into the same
        rows of out; ``soft_cap`` caps the scaled scores, ``sinks`` (heads,)
        float32 join each head's softmax denominator; ``kv_scales``: an fp8
        cache's key and value scales (stored x scale is the value)."""
        if not (q.is_contiguous() and cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("the CPU decode kernel needs contiguous q, cache and out")
        _, heads, head_dim = q.shape
        if sinks is not None and (
            sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous()
        ):
            raise ValueError(f"sinks must be a contiguous ({heads},) float32 tensor")
        page_size, kv_heads = cache.shape[2], cache.shape[3]
        args = (
            q.data_ptr(),
            DTYPE_CODES[q.dtype],
            cache.data_ptr(),
            CACHE_DTYPE_CODES[cache.dtype],
            out.data_ptr(),
            layout.rows_p,
            layout.lens_p,
            layout.indptr_p,
            layout.pages_p,
            page_size,
            heads,
            kv_heads,
            head_dim,
            window or 0,
            scale * kv_scales[0],
            soft_cap or 0.0,
            kv_scales[1],
            None if sinks is None else sinks.data_ptr(),
        )
        tasks = layout.num_rows * kv_heads
        if self._parallel is not None:
            self._check(self._parallel(*args, tasks, self.threads))
            return
        if self._pool is None or tasks < 2 * self.threads:
            self._check(self._fn(*args, 0, tasks))
            return
        bounds = np.linspace(0, tasks, self.threads + 1).astype(np.int64)
        futures = [
            self._pool.submit(self._fn, *args, int(a), int(b))
            for a, b in itertools.pairwise(bounds[1:])
        ]
        self._check(self._fn(*args, int(bounds[0]), int(bounds[1])))
        for f in futures:
            self._check(f.result())

    @staticmethod
    def _check(status: int) -> None:
        if status == -1:
            raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
        if status != 0:
            raise ValueError(f"the CPU decode kernel refused its arguments (status {status})")


class DecodeLayout:
    """One step's decode rows for the kernel: int64 arrays kept alive for the
    step, with their ctypes pointers made once (not once per layer). The pages
    are the page table's host array (rows, stride) int32, read in place: row
    i's pages start at cell ``indptr[i]`` = its table row * stride."""

    def __init__(
        self, rows: np.ndarray, lens: np.ndarray, table_rows: np.ndarray, pages: np.ndarray
    ) -> None:
        if pages.dtype != np.int32 or not pages.flags.c_contiguous or pages.ndim != 2:
            raise ValueError("the CPU decode kernel reads a C-contiguous 2-D int32 page table")
        # The kernel walks the rows in this order: by first page, so rows that
        # share prefix pages (the radix cache hands them the same ids) come one
        # after another and read those pages from the CPU's caches.
        table_rows = np.asarray(table_rows, dtype=np.int64)
        order = np.argsort(pages[table_rows, 0], kind="stable")
        self.num_rows = len(order)
        self.rows = np.ascontiguousarray(np.asarray(rows, dtype=np.int64)[order])
        self.lens = np.ascontiguousarray(np.asarray(lens, dtype=np.int64)[order])
        self.indptr = np.ascontiguousarray(table_rows[order] * pages.shape[1])
        self.pages = pages
        self.rows_p = self.rows.ctypes.data_as(_I64P)
        self.lens_p = self.lens.ctypes.data_as(_I64P)
        self.indptr_p = self.indptr.ctypes.data_as(_I64P)
        self.pages_p = self.pages.ctypes.data_as(_I32P)


def load_paged_decode(
    heads: int, kv_heads: int, head_dim: int, threads: int = 1
) -> PagedDecodeKernel | None:
    """The kernel for a model's (per-rank) attention shape, built if needed;
    None (and a warning) where it cannot be built or does not fit the shape."""
    if not PagedDecodeKernel.supports(torch.float32, heads, kv_heads, head_dim):
        logger.info("CPU decode kernel does not fit this model's heads; attention stays on torch")
        return None
    group = heads // kv_heads
    try:
        kernel = PagedDecodeKernel(build(group, head_dim, openmp=threads > 1), threads)
        if kernel.openmp and not one_openmp_runtime("CPU decode kernel"):
            kernel = PagedDecodeKernel(build(group, head_dim), threads)  # its plain build
        return kernel
    except (RuntimeError, OSError) as e:
        logger.warning("CPU decode kernel unavailable; attention stays on torch", error=str(e))
        return None
