"""Host <-> device copies that do not stall the step.

A plain ``torch.tensor(list, device="cuda")`` or ``cpu_tensor.to("cuda")`` copies
from pageable memory, which PyTorch follows with a stream synchronisation: the
host waits for every kernel queued so far. ``to_device`` instead packs host
arrays into one pinned buffer and copies it with ``non_blocking=True`` (PyTorch's
caching host allocator keeps the buffer alive until the copy ran), so the host
goes on queueing work. ``HostCopy`` is the other direction: one non-blocking
copy per tensor into pinned memory, queued when the step's kernels are, and a
single wait later, instead of one blocking ``.tolist()`` per tensor
(``to_host``: both at once). On a CPU device both are plain conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """``arrays`` (one dtype) as tensors on ``device``: one pinned buffer, one copy."""
    device = torch.device(device)
    if not arrays:
        return []
    if len({a.dtype for a in arrays}) > 1:
        raise ValueError(f"one dtype per copy, got {sorted({str(a.dtype) for a in arrays})}")
    sizes = [int(a.size) for a in arrays]
    packed = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    parts = packed.split(sizes)
    return [p.view(a.shape) for p, a in zip(parts, arrays, strict=True)]


class HostCopy:
    """Device tensors on their way to the host: the copies are queued when it
    is made, and ``wait`` is the one wait for them. Queue it right after the
    kernels that produce the tensors: a copy queued later (after the next
    step's kernels, overlap) would wait for those kernels too."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._done: torch.cuda.Event | None = None
        if not any(t.device.type == "cuda" for t in tensors):
            self._out = list(tensors)
            return
        self._out = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned destinations
        # An event, not a stream synchronize: the same wait, but not reported by
        # torch.cuda.set_sync_debug_mode, so a test can flag every other sync.
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host (waits for their copies once)."""
        if self._done is not None:
            self._done.synchronize()
        return self._out


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU after at most one wait for the current stream."""
    return HostCopy(tensors).wait()
