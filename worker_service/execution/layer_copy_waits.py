"""The forward's side of the host tier's layer-wise copies on CUDA
(device/host_kv_cuda.py): the model's attention behind a gate that makes
layer i's attention wait (on the device) for layer i's copies, so the
layers before it compute while the later ones still load. Everything but
``forward`` is the wrapped attention's."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LayerWaits(Protocol):
    def wait(self, layer: int) -> None: ...

    def wait_all(self) -> None: ...


class CopyGatedAttention:
    def __init__(self, attn: Any, waits: LayerWaits) -> None:
        self._attn = attn
        self._waits = waits

    def forward(self, layer: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._waits.wait(layer)
        return self._attn.forward(layer, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._attn, name)
