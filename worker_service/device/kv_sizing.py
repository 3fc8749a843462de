"""How many KV pages this rank allocates, in one pool or two (sliding-window
layers, kv_cache.py): which layers slide, the memory budget, the split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache, parse_bytes

CPU_KV_MEMORY = 1 << 30
GPU_KV_FRACTION = 0.9


@dataclass(frozen=True)
class KvPools:
    """The pools as the scheduler is told of them (GetInfo): full pages, and
    the sliding pool's pages (page 0 the null page; 0: one pool), layers and
    window (0: none)."""

    num_pages: int
    num_swa_pages: int = 0
    swa_layers: frozenset[int] = frozenset()
    swa_window: int = 0


def sliding_layers(
    windows: Sequence[int | None], *, max_context: int, enabled: bool
) -> tuple[frozenset[int], int]:
    """The layers whose KV lives in the sliding pool, and their window (none
    and 0: one pool). A window that covers the whole context frees nothing."""
    sliding = {i: w for i, w in enumerate(windows) if w is not None and w < max_context}
    if not enabled or not sliding:
        return frozenset(), 0
    if len(set(sliding.values())) > 1:
        raise SystemExit(
            f"sliding-window layers with different windows {sorted(set(sliding.values()))}: "
            "one sliding pool serves one window; run with --no-swa-memory"
        )
    return frozenset(sliding), next(iter(sliding.values()))


def kv_budget(kv_memory: str, device: torch.device) -> int:
    """--kv-memory in bytes; auto: 1 GiB on the CPU, 90% of the free GPU memory."""
    if kv_memory != "auto":
        return parse_bytes(kv_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_FRACTION)
    return CPU_KV_MEMORY


def size_kv_pools(
    windows: Sequence[int | None],
    *,
    max_context: int,
    swa_memory: bool,
    swa_ratio: float,
    num_pages: int | None,
    kv_memory: str,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tp: TensorParallel,
    device: torch.device,
) -> KvPools:
    """``windows``: each layer's (None: full attention); ``num_kv_heads``: this
    rank's. Sliding pages = ``swa_ratio`` x full pages, both within the budget
    (KvCache.split_budget), or ``num_pages`` full pages when given. Under
    tensor parallelism every rank takes the smallest rank's count."""
    swa_layers, window = sliding_layers(windows, max_context=max_context, enabled=swa_memory)
    if num_pages:
        pages = num_pages
    else:
        pages, _ = KvCache.split_budget(
            kv_budget(kv_memory, device),
            num_layers=len(windows),
            num_swa_layers=len(swa_layers),
            swa_ratio=swa_ratio,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        if tp.enabled:  # one scheduler pool for the group: every rank holds as many pages
            pages = int(tp.all_reduce_min(torch.tensor([pages], device=device)).item())
    if pages < 1:
        raise SystemExit(f"--kv-memory {kv_memory} holds not even one page of KV cache")
    if not swa_layers:
        return KvPools(pages)
    swa_pages = int(pages * swa_ratio)
    if swa_pages < 2:
        raise SystemExit(
            f"the sliding-window pool gets {swa_pages} pages (--swa-full-tokens-ratio "
            f"{swa_ratio} of {pages}); it needs its null page and at least one more"
        )
    return KvPools(pages, swa_pages, swa_layers, window)
