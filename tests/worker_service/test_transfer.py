"""worker_service.device.transfer: packed host -> device copies and the single-wait copy back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_service.device.transfer import to_device, to_host

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_keeps_values_and_shapes(device: str) -> None:
    arrays = [
        np.arange(5, dtype=np.int64),
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64),
        np.zeros(0, dtype=np.int64),
    ]
    out = to_device(arrays, device)
    assert [t.shape for t in out] == [(5,), (2, 3), (0,)]
    assert all(t.device.type == device and t.dtype == torch.int64 for t in out)
    for t, a in zip(to_host(*out), arrays, strict=True):
        assert t.device.type == "cpu"
        np.testing.assert_array_equal(t.numpy(), a)
    assert to_device([], device) == []


def test_to_device_refuses_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="one dtype"):
        to_device([np.zeros(2, np.int64), np.zeros(2, np.float32)], "cpu")


def test_to_host_on_cpu_returns_the_tensors() -> None:
    a, b = torch.ones(3), torch.arange(4)
    ha, hb = to_host(a, b)
    assert ha is a and hb is b
