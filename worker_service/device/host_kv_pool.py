"""The host tier's KV pages (SGLang's HiCache host pool): a pool in host memory
beside the device pool (kv_cache.py), and the page copies between them.

Per layer one host tensor shaped like the device layer's, with
``num_pages`` pages (one allocation, pinned on CUDA). The scheduler owns
which host page holds what, as it does for the device pool; the worker only
copies whole pages, every layer, when a plan says so
(``copy``: the plan's write-backs device -> host in list order, then its
loads host -> device, then the forward).

Copies move bytes: every tensor is viewed as uint8, so an fp8 cache
(kv_quant.py, per-layer scales that never change) is copied exactly and
torch's indexing kernels need not take float8. Sliding-window pools are not
served (the scheduler's host tier refuses them too): ``refusal`` says why.

Where the copies run: on the CPU, here, as plain batched ``index_select`` /
``index_copy_`` per layer, done before ``copy`` returns. On CUDA
(host_kv_cuda.py), on a copy stream, layer by layer, each layer's end an
event the forward's attention of that layer waits for.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import structlog
import torch

from worker_service.device.kv_cache import KvCache, parse_bytes

logger = structlog.get_logger(__name__)

GIB = 1 << 30


def refusal(kv_layout: KvCache) -> str | None:
    """Why this KV layout cannot have a host tier (None: it can)."""
    if kv_layout.swa_layers:
        return (
            "a model with sliding-window layers keeps them in a pool of their own, which "
            "the host tier does not serve yet (run without --enable-hierarchical-cache, "
            "or with --no-swa-memory)"
        )
    return None


def host_pages(*, device_pages: int, bytes_per_page: int, ratio: float, size_gib: float) -> int:
    """The host pool's pages: ``size_gib`` GiB of pages when > 0, else
    ``ratio`` x the device pool's pages (SGLang's --hicache-size and
    --hicache-ratio)."""
    if size_gib > 0:
        return int(size_gib * GIB // bytes_per_page)
    return int(device_pages * ratio)


def available_host_bytes() -> int | None:
    """Memory the kernel says is available (None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return parse_bytes(line.split()[1] + "KiB")
    except OSError:
        return None
    return None


def keep_last_writes(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` with each destination once, its last copy kept (a host
    page freed and reused while the plan was built is written twice; batched
    index copies with repeated destinations keep an undefined one)."""
    if len(np.unique(dst)) == len(dst):
        return src, dst
    _, first_from_end = np.unique(dst[::-1], return_index=True)
    keep = np.sort(len(dst) - 1 - first_from_end)
    return src[keep], dst[keep]


class HostKvPool:
    """``num_pages`` host pages shaped like ``kv``'s pages (module docstring)."""

    def __init__(self, kv: KvCache, num_pages: int) -> None:
        why = refusal(kv)
        if why is not None:
            raise ValueError(why)
        if num_pages < 1:
            raise ValueError("the host KV pool needs at least one page")
        self.kv = kv
        self.num_pages = num_pages
        self.cuda = kv.device.type == "cuda"
        page_shape = tuple(kv.layers[0].shape[1:])
        # One allocation for every layer; empty: a host page is read only after
        # a write-back filled it.
        self._storage = torch.empty(
            (kv.num_layers, num_pages, *page_shape), dtype=kv.dtype, pin_memory=self.cuda
        )
        self.layers = list(self._storage.unbind(0))
        self.bytes_per_page = kv.bytes_per_page(
            num_layers=kv.num_layers,
            page_size=kv.page_size,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            dtype=kv.dtype,
        )
        self._device_bytes = [layer.view(torch.uint8) for layer in kv.layers]
        self._host_bytes = [layer.view(torch.uint8) for layer in self.layers]
        self._cuda_copier = None
        if self.cuda:
            from worker_service.device.host_kv_cuda import CudaPageCopier

            self._cuda_copier = CudaPageCopier(self._device_bytes, self._host_bytes, kv.device)
        # Seconds each plan's copies took, for the metrics (``take_timings``).
        self._timings: deque[float] = deque(maxlen=4096)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def copy(
        self,
        write_back_device: np.ndarray,
        write_back_host: np.ndarray,
        load_host: np.ndarray,
        load_device: np.ndarray,
    ) -> object | None:
        """A plan's copies: write-backs (device -> host, the later of two to one
        host page kept), then loads (host -> device); int64 page-id columns,
        validated. CPU: done on return (None). CUDA: queued on the copy
        stream behind the work queued so far; returns the ``LayerEvents`` the
        forward's layers wait on (host_kv_cuda.py)."""
        write_back_device, write_back_host = keep_last_writes(write_back_device, write_back_host)
        if self._cuda_copier is not None:
            return self._cuda_copier.copy(
                write_back_device, write_back_host, load_host, load_device
            )
        started = time.perf_counter()
        wb_src, wb_dst, ld_src, ld_dst = (
            torch.from_numpy(a)
            for a in (write_back_device, write_back_host, load_host, load_device)
        )
        for device, host in zip(self._device_bytes, self._host_bytes, strict=True):
            if len(wb_src):
                host.index_copy_(0, wb_dst, device.index_select(0, wb_src))
            if len(ld_src):
                device.index_copy_(0, ld_dst, host.index_select(0, ld_src))
        self._timings.append(time.perf_counter() - started)
        return None

    def page_bytes(self) -> torch.Tensor:
        """The pool as bytes, ``[layers, pages, bytes of a layer's page]`` (a
        view: the file tier reads and fills whole pages through it)."""
        return self._storage.view(torch.uint8).reshape(self.kv.num_layers, self.num_pages, -1)

    def settle(self) -> None:
        """Wait for the copies queued so far (CUDA: the copy stream), so the
        host pages they write can be read by the host."""
        if self._cuda_copier is not None:
            self._cuda_copier.stream.synchronize()

    def take_timings(self) -> list[float]:
        """Seconds taken by the plans' copies finished since the last call (on
        CUDA those whose events have completed: no wait)."""
        if self._cuda_copier is not None:
            self._timings.extend(self._cuda_copier.finished_timings())
        out = list(self._timings)
        self._timings.clear()
        return out
