"""Whole KV pages as bytes, page-major (the KV transfer's payload, protos'
KvBatch): for each page in order, each layer in order, that layer's slice
of the page as the pool holds it (K then V, positions, heads, head_dim; the
KV dtype's raw bytes). One layout for any KV dtype (fp8 included: the same
model on both sides, so the same scales)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker_service.device.kv_cache import KvCache


class KvBytesError(ValueError):
    """Pages or bytes that do not fit the pool."""


def bytes_per_page(kv: KvCache) -> int:
    if kv.swa_layers:
        raise KvBytesError("a pool with sliding-window layers cannot send or take whole pages")
    return sum(layer[0].numel() * layer.element_size() for layer in kv.layers)


def check_pages(kv: KvCache, pages: Sequence[int]) -> None:
    """Raise KvBytesError unless every page is in the pool."""
    n = kv.layers[0].shape[0]
    bad = [p for p in pages if not 0 <= p < n][:5]
    if bad:
        raise KvBytesError(f"pages outside the pool [0, {n}): {bad}")


def _index(kv: KvCache, pages: Sequence[int]) -> torch.Tensor:
    check_pages(kv, pages)
    return torch.tensor(list(pages), dtype=torch.long, device=kv.layers[0].device)


def read_pages(kv: KvCache, pages: Sequence[int]) -> bytes:
    """The bytes of ``pages``, page-major."""
    index = _index(kv, pages)
    rows = [layer.view(torch.uint8)[index].reshape(len(pages), -1) for layer in kv.layers]
    return torch.cat(rows, dim=1).cpu().numpy().tobytes()


def write_pages(kv: KvCache, pages: Sequence[int], data: bytes | memoryview) -> None:
    """Write page-major ``data`` into ``pages`` (len(pages) pages of bytes)."""
    per_page = bytes_per_page(kv)
    if len(data) != len(pages) * per_page:
        raise KvBytesError(f"{len(data)} bytes for {len(pages)} pages of {per_page} bytes")
    if len(set(pages)) != len(pages):
        raise KvBytesError("a page named twice")
    index = _index(kv, pages)
    if not pages:
        return
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(pages), per_page)
    flat = flat.to(kv.layers[0].device)
    at = 0
    for layer in kv.layers:
        raw = layer.view(torch.uint8)
        width = raw[0].numel()
        raw[index] = flat[:, at : at + width].reshape((len(pages),) + tuple(raw.shape[1:]))
        at += width
