"""The host tier's copies on a GPU (scripts/gpu_check.sh runs these): pinned
host pages seen by the device, write-backs then loads on the copy stream
restoring every layer bit for bit, one event per layer, no host sync while
queueing them, and an attention gated on those events computing what the
ungated one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_service.device.host_kv_cuda import LayerEvents
from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import FP8_E4M3
from worker_service.execution.layer_copy_waits import CopyGatedAttention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _kv(dtype: torch.dtype, layers: int = 4, pages: int = 64) -> KvCache:
    kv = KvCache(
        num_layers=layers,
        num_pages=pages,
        page_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device="cuda",
    )
    for layer in kv.layers:
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda"))
    return kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_E4M3])
def test_round_trip_on_the_copy_stream_is_bit_for_bit(dtype):
    kv = _kv(dtype)
    before = [layer.view(torch.uint8).clone() for layer in kv.layers]
    pool = HostKvPool(kv, 48)
    assert pool.layers[0].is_pinned()
    torch.cuda.synchronize()
    events = _no_sync(lambda: pool.copy(ids(3, 17, 40, 41), ids(0, 47, 5, 0), ids(), ids()))
    assert isinstance(events, LayerEvents) and len(events.events) == len(kv.layers)
    events.wait_all()
    for layer in kv.layers:  # ordered after the write-backs by the wait
        layer.view(torch.uint8)[3:42].zero_()
    events = _no_sync(lambda: pool.copy(ids(), ids(), ids(0, 47, 5), ids(60, 61, 62)))
    events.wait_all()
    torch.cuda.synchronize()
    for layer, old in zip(kv.layers, before, strict=True):
        got = layer.view(torch.uint8)
        assert torch.equal(got[60], old[41])  # host page 0 written twice: the later copy
        assert torch.equal(got[61], old[17]) and torch.equal(got[62], old[40])
    assert len(pool.take_timings()) == 2


def _no_sync(queue):
    """``queue()`` with every host-device synchronization an error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return queue()
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Recorder:
    def __init__(self) -> None:
        self.layers: list[int] = []

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.layers.append(layer)
        return x * 2

    def begin_step(self, batch: object) -> str:
        return "begun"


def test_the_gate_waits_per_layer_and_delegates_the_rest():
    kv = _kv(torch.bfloat16, layers=3)
    pool = HostKvPool(kv, 8)
    events = pool.copy(ids(1, 2), ids(0, 1), ids(0), ids(9))
    inner = _Recorder()
    gated = CopyGatedAttention(inner, events)
    x = torch.ones(4, device="cuda")
    out = [gated.forward(i, x) for i in range(3)]
    assert inner.layers == [0, 1, 2] and gated.begin_step(None) == "begun"
    torch.cuda.synchronize()
    assert all(e.query() for e in events.events)
    assert all(torch.equal(o, x * 2) for o in out)
