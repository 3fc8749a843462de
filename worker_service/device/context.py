"""The worker's device, named once and selected on every thread that uses it.

``--device cuda`` names no GPU; ``torch.cuda.set_device`` refuses such a device
(torch >= 2.13), and streams, events and graph pools belong to whichever GPU
is current on the thread that makes them. So the worker resolves the device
once, at start, to an explicit ``cuda:N`` and every thread that touches CUDA
(the main thread that builds the model, the thread that executes plans)
selects that device before its first CUDA call: with ``--device cuda:1``,
tokens downloaded on a thread that never selected it would wait on GPU 0's
stream.

``cuda`` is the ``torch.cuda`` module unless a test hands in a recorder.
"""

from __future__ import annotations

from typing import Any

import torch


def resolve_device(name: str, cuda: Any = None) -> torch.device:
    """``cpu`` or an explicit ``cuda:N`` (``cuda`` alone: the current GPU)."""
    cuda = torch.cuda if cuda is None else cuda
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise SystemExit(f"--device {name!r}: {e}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise SystemExit(f"--device {name!r}: only cpu and cuda[:N] are supported")
    if not cuda.is_available():
        raise SystemExit(f"--device {name} asked for, but torch sees no CUDA device")
    index = cuda.current_device() if device.index is None else device.index
    if not 0 <= index < cuda.device_count():
        raise SystemExit(f"--device {name}: this machine has {cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def use_device(device: torch.device, cuda: Any = None) -> None:
    """Make ``device`` current on the calling thread (nothing to do on CPU)."""
    if device.type != "cuda":
        return
    if device.index is None:
        raise ValueError("resolve the device first: an explicit cuda:N is needed")
    (torch.cuda if cuda is None else cuda).set_device(device)


# Messages of CUDA errors after which the context cannot be trusted: the same
# process would fail every later call (or compute garbage). Out of memory is
# not one of them: torch raises it before anything ran.
_STICKY = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "device-side assert",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc error",
    "hardware stop",
    "launch timed out",
)


class DeviceFailure(RuntimeError):
    """The GPU's context is broken (a sticky CUDA error): only a new process
    can use the device again."""


def is_sticky_device_error(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return False
    text = str(error).lower()
    return "cuda error" in text and any(s in text for s in _STICKY)
