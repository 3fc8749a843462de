"""The host tier's copies on CUDA: a copy stream, layer by layer, no host wait.

The host pool is pinned memory, which CUDA maps into the device's address
space (unified addressing: the device pointer of a pinned buffer is its host
pointer), so a kernel reads and writes it directly over PCIe. The pool's
pages are seen as a CUDA tensor over that memory (``device_view``) and the
copies are the same batched ``index_select`` / ``index_copy_`` as on the
CPU, two kernels per layer and direction, however scattered the pages
(SGLang's "kernel" I/O backend does the same with kernels of its own). A
round trip at start checks the mapping (``check_mapping``).

Ordering, all on the device (the host never waits in a step):

- the copy stream first waits for everything queued on the compute stream
  so far: the previous plans' forwards wrote the pages a write-back reads
  and read the pages a load overwrites;
- per layer, the plan's write-backs, then its loads, then an event
  (``LayerEvents``): a load reads a host page after a write-back of the
  same plan filled it, and a write-back reads its device page before a load
  of the same plan overwrites it;
- the forward's attention of layer i waits for event i
  (execution/layer_copy_waits.py), so the first layers compute while the
  later ones load (SGLang's layer-wise overlap), and the compute stream
  waits for the last event before anything after the forward (and at once
  for a plan with no forward): the next plan's forward may write a page
  this plan wrote back.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from worker_service.device.transfer import to_device


class _CudaArray:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at a device address."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over pinned ``host`` memory (unified addressing), of
    ``host``'s shape in bytes. ``host`` must outlive it."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("a device view needs contiguous pinned host memory")
    raw = host.view(torch.uint8)
    flat = torch.as_tensor(_CudaArray(raw.data_ptr(), raw.numel()), device=device)
    return flat.view(raw.shape)


class LayerEvents:
    """One event per layer on the copy stream: layer i's copies are done."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait(self, layer: int) -> None:
        """The current stream waits for layer ``layer``'s copies (not the host)."""
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self.events[-1])


class CudaPageCopier:
    """Copies between device layers and pinned host layers (both uint8 views,
    one per layer) on a stream of its own (module docstring)."""

    def __init__(
        self,
        device_layers: list[torch.Tensor],
        host_layers: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.device_layers = device_layers
        self.host_views = [device_view(h, device) for h in host_layers]
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        check_mapping(host_layers[0], self.host_views[0])

    def copy(
        self,
        write_back_device: np.ndarray,
        write_back_host: np.ndarray,
        load_host: np.ndarray,
        load_device: np.ndarray,
    ) -> LayerEvents:
        compute = torch.cuda.current_stream(self.device)
        # Uploaded on the compute stream (pinned, non-blocking), read on the copy stream.
        ids = to_device([write_back_device, write_back_host, load_host, load_device], self.device)
        wb_src, wb_dst, ld_src, ld_dst = ids
        queued = torch.cuda.Event()
        queued.record(compute)
        start = torch.cuda.Event(enable_timing=True)
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            for t in ids:  # the allocator must not hand them out before the copies ran
                t.record_stream(self.stream)
            start.record(self.stream)
            last = len(self.device_layers) - 1
            for i, (device, host) in enumerate(
                zip(self.device_layers, self.host_views, strict=True)
            ):
                if len(write_back_device):
                    host.index_copy_(0, wb_dst, device.index_select(0, wb_src))
                if len(load_host):
                    device.index_copy_(0, ld_dst, host.index_select(0, ld_src))
                event = torch.cuda.Event(enable_timing=i == last)
                event.record(self.stream)
                events.append(event)
        self._timed.append((start, events[-1]))
        return LayerEvents(events)

    def finished_timings(self) -> list[float]:
        """Seconds of the copies whose last event has completed (``query``
        does not wait), oldest first."""
        out = []
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            out.append(start.elapsed_time(end) / 1e3)
        return out


def check_mapping(host: torch.Tensor, view: torch.Tensor) -> None:
    """At start (it waits for the device): bytes written through the device view
    are the host's, and back. A platform without unified addressing fails here,
    by name, rather than in a step."""
    n = min(view.numel(), 4096)
    pattern = (torch.arange(n, dtype=torch.int64, device=view.device) % 251).to(torch.uint8)
    flat_view = view.view(-1)[:n]
    flat_view.copy_(pattern)
    torch.cuda.synchronize(view.device)
    flat_host = host.view(torch.uint8).view(-1)[:n]
    if not torch.equal(flat_host, pattern.cpu()):
        raise SystemExit(
            "--enable-hierarchical-cache: this GPU does not see pinned host memory at its host "
            "address (no unified addressing); the host KV tier cannot run here"
        )
    flat_host.zero_()
    if int(flat_view.sum().item()) != 0:
        raise SystemExit(
            "--enable-hierarchical-cache: writes to pinned host memory are not seen by the GPU; "
            "the host KV tier cannot run here"
        )
