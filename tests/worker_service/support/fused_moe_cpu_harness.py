"""Runs our MoE layer through FlashInfer's real ``cutlass_fused_moe`` Python
wrapper (flashinfer/fused_moe/core.py) on a machine without a GPU, as
flashinfer_cpu_harness.py does for attention: only the compiled module and
the CUDA-only facilities are swapped, for the duration of one test.

What is replaced, and why:

* ``get_cutlass_fused_moe_module(arch)``: the JIT-built module the wrapper
  calls (``.cutlass_fused_moe(output, input, ...)``, positional as the
  wrapper passes them). The stand-in checks the arguments against the
  kernel's contract (``FusedMoeContract``: bf16 activations and weights,
  int32 expert ids and float32 scales of one shape, fc1 (E, 2I, H) with
  [up | gate] rows, fc2 (E, H, I), contiguous, biases of their GEMM's rows,
  SwiGLU parameters as (E,) float32 tensors or none, no quantisation,
  tp/ep/cluster 1 since the weights arrive sharded), records the call, and
  computes the documented result in torch: per token and chosen expert,
  ``gate * sigmoid(alpha * gate) * (up + beta)`` with gate clamped above at
  ``limit`` and up to +-``limit`` (defaults 1, 0, float max: SiLU-gated),
  then the down GEMM plus its bias, weighted by the scale and summed;
* ``get_compute_capability``: sm90 (an H100/H200);
* ``device_support_pdl``: False;
* ``torch`` as seen by fused_moe/core.py: the same module except that
  ``torch.cuda.device(...)`` is a no-op context (the wrapper enters it
  around the call);
* our ``choose_moe_kernel``: FlashInfer on the CPU, in bf16.

Everything else in the wrapper runs as shipped: its argument checks, the
output shape/dtype check, the dispatch by architecture.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import worker_service.models.moe_kernel as moe_kernel

# The compiled op's positional parameters, as fused_moe/core.py passes them.
POSITIONAL = (
    "output",
    "input",
    "token_selected_experts",
    "token_final_scales",
    "fc1_expert_weights",
    "fc1_expert_biases",
    "fc2_expert_weights",
    "fc2_expert_biases",
    "output_dtype",
    "quant_scales",
    "input_sf",
    "swiglu_alpha",
    "swiglu_beta",
    "swiglu_limit",
    "clamped_relu2_limit",
    "situ_beta",
    "situ_linear_beta",
    "swizzled_input_sf",
    "tp_size",
    "tp_rank",
    "ep_size",
    "ep_rank",
    "cluster_size",
    "cluster_rank",
)


class FusedMoeContractError(AssertionError):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise FusedMoeContractError(what)


@dataclass
class ReferenceFusedMoeModule:
    """What ``get_cutlass_fused_moe_module(arch)`` returns under the harness."""

    arch: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def cutlass_fused_moe(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        a = dict(zip(POSITIONAL, args, strict=False)) | kwargs
        self._check(a)
        self.calls.append(a)
        a["output"].copy_(self._compute(a))
        return [a["output"]]

    @staticmethod
    def _check(a: dict[str, Any]) -> None:
        from flashinfer.tllm_enums import ActivationType

        x, ids, scales = a["input"], a["token_selected_experts"], a["token_final_scales"]
        fc1, fc2 = a["fc1_expert_weights"], a["fc2_expert_weights"]
        _need(x.dtype == torch.bfloat16, f"input is {x.dtype}, the dense runner takes bf16")
        _need(fc1.dtype == fc2.dtype == torch.bfloat16, "weights must be bf16")
        _need(ids.dtype == torch.int32, f"expert ids are {ids.dtype}, not int32")
        _need(scales.dtype == torch.float32, f"scales are {scales.dtype}, not float32")
        _need(ids.shape == scales.shape and ids.shape[0] == x.shape[0], "ids/scales shape")
        e, two_i, h = fc1.shape
        _need(two_i % 2 == 0 and h == x.shape[1], f"fc1 {tuple(fc1.shape)} for input {x.shape}")
        _need(tuple(fc2.shape) == (e, h, two_i // 2), f"fc2 {tuple(fc2.shape)} vs fc1")
        for name in ("input", "token_selected_experts", "token_final_scales"):
            _need(a[name].is_contiguous(), f"{name} not contiguous")
        _need(fc1.is_contiguous() and fc2.is_contiguous(), "weights not contiguous")
        _need(int(ids.min()) >= 0 and int(ids.max()) < e, "expert id out of range")
        for name, rows in (("fc1_expert_biases", two_i), ("fc2_expert_biases", h)):
            b = a[name]
            _need(b is None or tuple(b.shape) == (e, rows), f"{name} shape")
        for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
            t = a[name]
            _need(t is None or (t.dtype == torch.float32 and tuple(t.shape) == (e,)), name)
        _need(a["activation_type"] == ActivationType.Swiglu, "activation must be Swiglu")
        _need(not a["quant_scales"] and a["input_sf"] is None, "bf16 takes no quantisation")
        parallel = [a[k] for k in ("tp_size", "ep_size", "cluster_size")]
        _need(parallel == [1, 1, 1], f"tp/ep/cluster sizes {parallel}: weights arrive sharded")
        _need(a["output"].dtype == a["output_dtype"] == x.dtype, "output dtype")

    @staticmethod
    def _compute(a: dict[str, Any]) -> torch.Tensor:
        x, ids, scales = a["input"], a["token_selected_experts"], a["token_final_scales"]
        fc1, fc2 = a["fc1_expert_weights"], a["fc2_expert_weights"]
        b1, b2 = a["fc1_expert_biases"], a["fc2_expert_biases"]
        i = fc1.shape[1] // 2
        out = torch.zeros_like(x)
        for e in range(fc1.shape[0]):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = F.linear(x[rows], fc1[e], None if b1 is None else b1[e])
            up, gate = h[:, :i], h[:, i:]
            alpha, beta, limit = 1.0, 0.0, None
            if a["swiglu_alpha"] is not None:
                alpha, beta = float(a["swiglu_alpha"][e]), float(a["swiglu_beta"][e])
                limit = float(a["swiglu_limit"][e])
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = gate * torch.sigmoid(alpha * gate) * (up + beta)
            y = F.linear(act, fc2[e], None if b2 is None else b2[e])
            out.index_add_(0, rows, y * scales[rows, slots, None].to(y.dtype))
        return out


class _TorchWithoutCudaDevice(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(device=lambda *_: contextlib.nullcontext())

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def install_fused_moe_harness(monkeypatch: pytest.MonkeyPatch) -> ReferenceFusedMoeModule:
    """Install the stand-ins; returns the reference module (its ``calls``)."""
    import flashinfer.fused_moe.core as core

    module = ReferenceFusedMoeModule()

    def get_module(arch: str = "100", use_fast_build: bool = False) -> ReferenceFusedMoeModule:
        module.arch = arch
        return module

    monkeypatch.setattr(core, "get_cutlass_fused_moe_module", get_module)
    monkeypatch.setattr(core, "get_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(core, "device_support_pdl", lambda device: False)
    monkeypatch.setattr(core, "torch", _TorchWithoutCudaDevice())

    def choose(device: torch.device, dtype: torch.dtype) -> moe_kernel.MoeKernelChoice:
        if dtype == torch.bfloat16:
            return moe_kernel.MoeKernelChoice("flashinfer", "")
        return moe_kernel.MoeKernelChoice("torch", "the harness's kernels are bf16 too")

    monkeypatch.setattr(moe_kernel, "choose_moe_kernel", choose)
    return module
