"""Runs our FlashInfer backend through FlashInfer's real Python wrappers on a machine
without a GPU: only the compiled modules and the CUDA-only facilities are swapped,
each narrowly, for the duration of one test (pytest's monkeypatch undoes them).

What is replaced, and why:

* The JIT specs the wrappers build their modules from:
  ``flashinfer.prefill._gen_batch_prefill_primary_module`` (and its independent-stride
  twin) for FA2 prefill, which the tensor-core decode path also uses, and
  ``flashinfer.decode.gen_batch_decode_module`` for the CUDA-core decode kernel.
  Their ``build_and_load()`` returns the reference modules of flashinfer_reference.py.
  Everything above them runs as shipped: ``get_batch_prefill_module`` /
  ``get_batch_decode_module`` (which reorder arguments and invert rope scales for
  the kernel), the wrappers' ``__init__``/``plan``/``run``, their checks, buffer
  handling and CUDA-graph buffer copies. Their ``functools.cache`` is cleared before
  and after, so no reference module outlives the test.
* ``torch`` as seen by flashinfer.prefill / flashinfer.decode: the same module except
  that ``torch.empty(..., pin_memory=True)`` (the wrappers' page-locked int
  workspace) allocates plain host memory, since a CPU-only torch has no pinned
  allocator.
* ``flashinfer.{prefill,decode}.get_seq_lens``: the real one, after checking that the
  indptr and last_page_len it reads on the host are not device memory; and the
  wrappers' ``plan``: the real one, after checking that the index arrays it copies
  to the device are pinned or already there (``_check_plan_placement``).
* Our backend's ``CUDA`` facilities (worker_service/attention/flashinfer_backend.py):
  the CPU device counts as usable, "pinning", "copying to the device" and the
  backend's own device buffers register the tensors in ``Placement`` (the device
  copy is a real copy), the plan event is a no-op.
* For CUDA graphs (``install_graph_stand_ins``): ``torch.cuda.CUDAGraph`` /
  ``graph`` / streams / ``synchronize`` as used by worker_service/execution/cuda_graphs.py,
  backed by flashinfer_reference.GraphTape; our ``store_kv``, ``scale_output`` (an
  fp8 cache's value scale) and DecodeGraphs' ``keep_output`` launch through the
  tape too, since under a real graph their copies are captured kernels.
  ``graph_pool_handle`` gives a ``SharedPool``: what a test's forward allocates
  with ``pool_empty`` during a capture comes from one arena shared by every
  capture into that pool, first fit, and ``pool_free`` returns it, as the caching
  allocator does with a graph pool (a block freed after one capture is handed to
  the next capture, while the graph that freed it still writes it).
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import worker_service.attention.flashinfer_backend as backend
import worker_service.execution.cuda_graphs as cuda_graphs
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.flashinfer_reference import (
    GraphTape,
    KernelContractError,
    Placement,
)
from tests.worker_service.support.flashinfer_reference_modules import (
    ReferenceDecodeModule,
    ReferencePrefillModule,
)


class _JitSpecStandIn:
    """What the wrappers' module getters call ``build_and_load()`` on."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build

    def build_and_load(self) -> Any:
        return self._build()


class _TorchWithoutPinnedMemory(types.ModuleType):
    """``torch`` for FlashInfer's prefill/decode modules, but host-only pinning."""

    def __init__(self, placement: Placement) -> None:
        super().__init__("torch")
        self._placement = placement

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        t = torch.empty(*args, **kwargs)
        return self._placement.mark_pinned(t) if pin_memory else t


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuFacilities(backend.CudaFacilities):
    """Our backend's CUDA calls on the CPU: the device is the host, but what the
    backend pins and what it copies to the device are told apart (``Placement``)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def usable(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def on_host(self, t: torch.Tensor) -> bool:
        return not self.placement.is_device(t)

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return self.placement.mark_pinned(host)

    def to_device(self, pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self.placement.mark_device(pinned.to(device, copy=True))

    def event(self) -> Any:
        return _NoEvent()

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.placement.mark_device(torch.empty(n, dtype=dtype, device=device))


def clear_module_caches() -> None:
    """Forget the modules FlashInfer built (here: reference ones); call after a test."""
    import flashinfer.decode
    import flashinfer.prefill

    flashinfer.prefill.get_batch_prefill_module.cache_clear()
    flashinfer.decode.get_batch_decode_module.cache_clear()


def _refuse(*args: Any) -> Any:
    raise KernelContractError(f"no reference for this FlashInfer module {args[:1]}")


def _let_workers_choose_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker built under the harness (``--attention-backend flashinfer`` on
    the CPU) gets FlashInfer as asked: the start-time choice would refuse it
    off CUDA, and for the tiny models' head dims, which the reference kernels
    take; the modules it loads are the references, so no prebuilt set applies."""
    import worker_service.worker as worker_module
    from worker_service.attention.attention_choice import AttentionChoice

    real_choose = worker_module.choose_attention

    def choose(requested: str, **kwargs: Any) -> AttentionChoice:
        if requested == "flashinfer":
            return AttentionChoice("flashinfer")
        return real_choose(requested, **kwargs)

    monkeypatch.setattr(worker_module, "choose_attention", choose)
    monkeypatch.setattr(worker_module, "_check_flashinfer_modules", lambda *a, **k: None)


def install(monkeypatch: pytest.MonkeyPatch) -> Placement:
    """Swap in the reference kernels and the CPU stand-ins; returns the placement
    registry. Call ``clear_module_caches()`` after the test."""
    import flashinfer.decode
    import flashinfer.prefill

    placement = Placement()
    monkeypatch.setattr(reference, "PLACEMENT", placement)
    monkeypatch.setattr(reference, "TAPE", GraphTape())
    monkeypatch.setattr(reference, "CALLS", Counter())
    monkeypatch.setattr(backend, "CUDA", CpuFacilities(placement))
    _let_workers_choose_flashinfer(monkeypatch)

    def prefill_spec(backend_name: str, *jit_args: Any) -> _JitSpecStandIn:
        return _JitSpecStandIn(lambda: ReferencePrefillModule(backend_name, *jit_args))

    def decode_spec(*jit_args: Any) -> _JitSpecStandIn:
        return _JitSpecStandIn(lambda: ReferenceDecodeModule(*jit_args))

    monkeypatch.setattr(flashinfer.prefill, "_gen_batch_prefill_primary_module", prefill_spec)
    monkeypatch.setattr(
        flashinfer.prefill, "_gen_batch_prefill_independent_paged_module", prefill_spec
    )
    monkeypatch.setattr(flashinfer.prefill, "gen_batch_prefill_module", _refuse)
    monkeypatch.setattr(flashinfer.decode, "gen_batch_decode_module", decode_spec)

    pinless = _TorchWithoutPinnedMemory(placement)
    for module in (flashinfer.prefill, flashinfer.decode):
        monkeypatch.setattr(module, "torch", pinless)
        real_seq_lens = module.get_seq_lens

        def seq_lens(
            kv_indptr: torch.Tensor,
            last_page_len: torch.Tensor,
            page_size: int,
            _real: Callable[..., torch.Tensor] = real_seq_lens,
        ) -> torch.Tensor:
            reference.PLACEMENT.require_host("kv_indptr (get_seq_lens)", kv_indptr)
            reference.PLACEMENT.require_host("last_page_len (get_seq_lens)", last_page_len)
            return _real(kv_indptr, last_page_len, page_size)

        monkeypatch.setattr(module, "get_seq_lens", seq_lens)

    _check_plan_placement(monkeypatch)
    clear_module_caches()
    return placement


# Positions of (indptr, indices, last_page_len) in each wrapper's plan().
_PLAN_INDEX_ARGS = {"BatchPrefillWithPagedKVCacheWrapper": (1, 2, 3)}
_PLAN_INDEX_ARGS["BatchDecodeWithPagedKVCacheWrapper"] = (0, 1, 2)


def _check_plan_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the index arrays given to a wrapper's plan() must live so that it never
    waits for the GPU, per the 0.7.2.post1 wrappers: each is copied to the device with
    non_blocking=True (pageable host memory would make that copy synchronous), and
    under CUDA graphs the page indices are copied into the fixed buffer with
    non_blocking only if already on the device. (indptr and last_page_len being read
    on the host is checked where FlashInfer reads them.)"""
    import flashinfer

    for name, (indptr_at, indices_at, last_at) in _PLAN_INDEX_ARGS.items():
        cls = getattr(flashinfer, name)
        real = cls.plan

        def plan(
            self: Any,
            *args: Any,
            _real: Callable[..., Any] = real,
            _at: tuple[int, int, int] = (indptr_at, indices_at, last_at),
            _name: str = name,
            **kwargs: Any,
        ) -> Any:
            for i, what in zip(_at, ("indptr", "indices", "last_page_len"), strict=True):
                reference.PLACEMENT.require_pinned_or_device(f"{_name}.plan {what}", args[i])
            if self.is_cuda_graph_enabled:
                reference.PLACEMENT.require_device(f"{_name}.plan indices", args[_at[1]])
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "plan", plan)


# ---- CUDA graphs -------------------------------------------------------------------------


class _TapeGraph:
    """``torch.cuda.CUDAGraph`` stand-in: replay re-runs the launches recorded at capture."""

    def __init__(self) -> None:
        self.launches: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def replay(self) -> None:
        # A real replay runs kernels, nothing autograd could see: inference mode, so
        # the model's inference tensors (it runs under inference_mode) can be rewritten.
        with torch.inference_mode():
            for kernel, args in self.launches:
                kernel(*args)


class SharedPool:
    """A graph memory pool: one arena, blocks handed out first fit (512-byte
    aligned, as CUDA's allocator) and split; a freed block is free for any later
    capture into the pool."""

    ALIGN = 512

    def __init__(self, nbytes: int = 1 << 22) -> None:
        self.arena = torch.zeros(nbytes, dtype=torch.uint8)
        self.free_blocks: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted
        self.blocks: dict[int, tuple[int, int]] = {}  # data_ptr -> its block

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        for i, (offset, free) in enumerate(self.free_blocks):
            if free >= size:
                self.free_blocks[i : i + 1] = [(offset + size, free - size)] if free > size else []
                t = self.arena[offset : offset + nbytes].view(dtype).view(shape)
                self.blocks[t.data_ptr()] = (offset, size)
                return t
        raise MemoryError("stand-in graph pool exhausted")

    def free(self, t: torch.Tensor) -> None:
        self.free_blocks.append(self.blocks.pop(t.data_ptr()))
        self.free_blocks.sort()
        merged: list[tuple[int, int]] = []
        for offset, size in self.free_blocks:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self.free_blocks = merged


_CAPTURING_INTO: list[SharedPool] = []  # the pool of the capture in progress, if any


@contextlib.contextmanager
def _capture(graph: _TapeGraph, pool: Any = None, **_: Any) -> Iterator[None]:
    reference.TAPE.start()
    if isinstance(pool, SharedPool):
        _CAPTURING_INTO.append(pool)
    try:
        yield
    finally:
        graph.launches = reference.TAPE.stop()
        _CAPTURING_INTO.clear()


def pool_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` for a test's forward: from the pool while a graph captures
    into one, from the host allocator otherwise (warm-up, eager runs)."""
    if _CAPTURING_INTO:
        return _CAPTURING_INTO[-1].empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def pool_free(t: torch.Tensor) -> None:
    """What the caching allocator does when a forward's intermediate goes out of scope."""
    if _CAPTURING_INTO:
        _CAPTURING_INTO[-1].free(t)


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass


def install_graph_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let worker_service.execution.cuda_graphs.DecodeGraphs capture and replay on the CPU."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", SharedPool)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _TapeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    real_store_kv = backend.store_kv

    def store_kv(*args: Any, **kwargs: Any) -> None:
        reference.TAPE.launch(lambda: real_store_kv(*args, **kwargs))

    monkeypatch.setattr(backend, "store_kv", store_kv)
    real_scale_output = backend.scale_output

    def scale_output(*args: Any) -> None:
        reference.TAPE.launch(real_scale_output, *args)

    monkeypatch.setattr(backend, "scale_output", scale_output)
    real_keep_output = cuda_graphs.keep_output

    def keep_output(*args: Any) -> None:
        reference.TAPE.launch(real_keep_output, *args)

    monkeypatch.setattr(cuda_graphs, "keep_output", keep_output)


def launch(kernel: Callable[..., Any], *args: Any) -> None:
    """Run ``kernel`` now, or record it if a graph is capturing (for a test's own ops)."""
    reference.TAPE.launch(kernel, *args)


# ---- whole-model graphs: every torch op recorded ----------------------------------------


class _OpRecorder(TorchDispatchMode):
    """While a stand-in graph captures a whole model: every aten op runs (its
    outputs give the capture its tensors) and is recorded on the tape, to run
    again at replay on the very tensors of the capture with its results copied
    into the capture's outputs; what a captured kernel does. A host read
    (``.item()``, ``.tolist()``) fails, as it fails a real capture."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise KernelContractError(f"host read during graph capture: {func}")
        out = func(*args, **kwargs)
        reference.TAPE.launch(_rerun, func, args, kwargs, out)
        return out


def _rerun(func: Any, args: Any, kwargs: Any, captured: Any) -> None:
    result = func(*args, **kwargs)
    pairs = (
        zip(captured, result, strict=True)
        if isinstance(captured, tuple | list)
        else [(captured, result)]
    )
    for old, new in pairs:
        if isinstance(old, torch.Tensor) and new is not old and old.data_ptr() != new.data_ptr():
            old.copy_(new)


@contextlib.contextmanager
def _capture_model(graph: _TapeGraph, pool: Any = None, **_: Any) -> Iterator[None]:
    with _capture(graph, pool), _OpRecorder():
        yield


def install_model_graph_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """install_graph_stand_ins, and captures record every torch op as well, so
    a whole model's forward (ModelCompute.capture_decode_graphs) replays."""
    install_graph_stand_ins(monkeypatch)
    monkeypatch.setattr(torch.cuda, "graph", _capture_model)
