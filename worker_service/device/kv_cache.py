"""The physical KV pages: per layer one tensor of shape
``(pages, 2, page_size, num_kv_heads, head_dim)`` (FlashInfer's NHD
paged layout: index 0 holds keys, 1 values).

Position p of a request lives at ``[table[p // page_size], :, p % page_size]``.
The scheduler owns which page holds what; this class only stores and reads.

Two pools (a model with sliding-window layers): the layers in ``swa_layers``
hold ``num_swa_pages`` pages, indexed by the requests' sliding page tables;
the others ``num_pages``, indexed by the full tables. Page 0 of the sliding
pool is the null page: the scheduler never hands it out, a freed (out of
window) entry of a sliding table names it, and it is only ever read masked.
``split_budget`` sizes the two within one memory budget.

``dtype`` is what the pages hold: the model's, or float8_e4m3fn
(``--kv-cache-dtype fp8_e4m3``, kv_quant.py), one byte an element, so a
budget holds 2x the bf16 pages and 4x the fp32 ones. An fp8 cache
quantizes on ``write`` with its layer's ``scales`` and dequantizes on
``read`` (and ``dequantize``) to ``compute_dtype``.
"""

from __future__ import annotations

import re

import torch

from worker_service.device.kv_quant import FP8_E4M3, KvScales, dequantize_fp8, quantize_fp8
from worker_service.device.kv_shared_memory import allocate_layers

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '2GB' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class KvCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        swa_layers: frozenset[int] = frozenset(),
        num_swa_pages: int = 0,
        compute_dtype: torch.dtype | None = None,
        scales: KvScales | None = None,
        shared_memory: bool = False,
    ) -> None:
        """``compute_dtype``: what reads return (None: ``dtype``); ``scales``:
        an fp8 cache's per-layer scales (None: 1.0); ``shared_memory``: the
        layers in one /dev/shm file that a prefill worker on this host may
        write pages into (``shared_path``; CPU only)."""
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        if swa_layers and num_swa_pages < 2:
            raise ValueError("the sliding pool needs its null page and at least one more")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.swa_layers = frozenset(swa_layers)
        self.num_swa_pages = num_swa_pages if swa_layers else 0
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        self.quantized = dtype == FP8_E4M3
        self.scales = KvScales.ones(num_layers) if scales is None else scales
        if len(self.scales.k) != num_layers or len(self.scales.v) != num_layers:
            raise ValueError(f"KV scales for {len(self.scales.k)} layers, not {num_layers}")
        self.device = torch.device(device)
        shapes = [
            (num_swa_pages if i in self.swa_layers else num_pages, 2, page_size)
            + (num_kv_heads, head_dim)
            for i in range(num_layers)
        ]
        self.shared_path = ""
        if shared_memory:
            if self.device.type != "cpu" or self.swa_layers:
                raise ValueError("a shared-memory KV pool needs a CPU pool without sliding layers")
            self.shared_path, self.layers = allocate_layers(shapes, dtype)
        else:
            self.layers = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]

    @property
    def has_full_layers(self) -> bool:
        return len(self.swa_layers) < self.num_layers

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        *,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        per_page = cls.bytes_per_page(
            num_layers=num_layers,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        return budget_bytes // per_page

    @classmethod
    def split_budget(
        cls,
        budget_bytes: int,
        *,
        num_layers: int,
        num_swa_layers: int,
        swa_ratio: float,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[int, int]:
        """(full pages, sliding pages) with sliding pages = ``swa_ratio`` x full
        pages and full x full-layer bytes + sliding x sliding-layer bytes within
        the budget (SGLang's split). Without sliding layers: all full, sliding
        0. Every layer sliding: the full pool costs nothing (no layer stores
        in it) and only sizes the scheduler's bookkeeping, at 1 / ratio the
        sliding pool's pages."""
        layer_page = cls.bytes_per_page(
            num_layers=1,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        full_bytes = (num_layers - num_swa_layers) * layer_page
        if not num_swa_layers:
            return budget_bytes // full_bytes, 0
        full = int(budget_bytes // (full_bytes + swa_ratio * num_swa_layers * layer_page))
        return full, int(full * swa_ratio)

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        pages: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """Store k, v (T, kv_heads, head_dim) of T positions at (pages[i], offsets[i])."""
        cache = self.layers[layer]
        if self.quantized:
            # As bytes: torch's indexing kernels need not take float8 on every device.
            raw = cache.view(torch.uint8)
            raw[pages, 0, offsets] = quantize_fp8(k, self.scales.k[layer]).view(torch.uint8)
            raw[pages, 1, offsets] = quantize_fp8(v, self.scales.v[layer]).view(torch.uint8)
            return
        cache[pages, 0, offsets] = k.to(cache.dtype)
        cache[pages, 1, offsets] = v.to(cache.dtype)

    def dequantize(self, layer: int, stored: torch.Tensor, which: int) -> torch.Tensor:
        """Stored keys (``which`` 0) or values (1) of ``layer`` in ``compute_dtype``."""
        if not self.quantized:
            return stored.to(self.compute_dtype)
        scale = (self.scales.k if which == 0 else self.scales.v)[layer]
        return dequantize_fp8(stored, scale, self.compute_dtype)

    def read(
        self, layer: int, page_table: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (kv_len, kv_heads, head_dim) of positions [0, kv_len),
        dequantized to ``compute_dtype``."""
        cache = self.layers[layer]
        if self.quantized:
            pages = cache.view(torch.uint8)[page_table].view(cache.dtype)
        else:
            pages = cache[page_table]  # (n, 2, page_size, H, D)
        k = pages[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        v = pages[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        return self.dequantize(layer, k, 0), self.dequantize(layer, v, 1)
