"""Which kernel runs the MoE experts, decided at start (before the weights
load, so their layout can follow it), and FlashInfer's fused MoE call.

FlashInfer 0.7.2's ``cutlass_fused_moe`` (flashinfer/fused_moe/core.py) runs
routing-given experts in one call: gate/up GEMM with the activation fused
(SwiGLU, with GPT-OSS's alpha / beta / limit as per-expert float32
tensors), down GEMM, and the weighted sum over the k experts. Its dense
path takes bf16 weights and activations only (its ``CutlassBf16Runner``:
BF16 x BF16; fp16 and fp32 have no runner) on sm89, sm90, sm100/103/107/110
and sm120/121 (``_CUTLASS_BF16_ARCHS``). Its GEMM1 rows are [up | gate]
(``act(x @ w1[I:].T) * (x @ w1[:I].T)``), the reverse of ours, so a
FlashInfer worker loads the experts' gate/up rows in that order.

Elsewhere (CPU, fp16/fp32, other GPUs, FlashInfer not installed) the grouped
torch path (models/moe_experts.py) runs, and on CUDA the worker says so at
start. Either way the decode forward of a MoE model runs without CUDA graphs:
the grouped path reads the per-expert counts on the host, and the fused
call's first use per shape autotunes on the host, which a graph capture
cannot hold (not yet measured on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# FlashInfer 0.7.2's fused_moe/api.py: _CUTLASS_BF16_ARCHS.
FUSED_MOE_ARCHS = (89, 90, 100, 103, 107, 110, 120, 121)


@dataclass(frozen=True)
class MoeKernelChoice:
    name: str  # "flashinfer" | "torch"
    reason: str  # why not FlashInfer ("" when it is)


def choose_moe_kernel(device: torch.device, dtype: torch.dtype) -> MoeKernelChoice:
    if device.type != "cuda":
        return MoeKernelChoice("torch", "not on CUDA")
    if dtype != torch.bfloat16:
        return MoeKernelChoice(
            "torch", f"FlashInfer's fused MoE takes bf16 weights only, the model runs {dtype}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major * 10 + minor not in FUSED_MOE_ARCHS:
        return MoeKernelChoice(
            "torch", f"FlashInfer's fused MoE has no kernels for sm{major}{minor}"
        )
    try:
        import flashinfer.fused_moe  # noqa: F401
    except ImportError as err:
        return MoeKernelChoice("torch", f"FlashInfer's fused MoE cannot be imported: {err}")
    return MoeKernelChoice("flashinfer", "")


@dataclass
class FusedMoeCall:
    """``cutlass_fused_moe`` with the layer's fixed arguments."""

    run: Callable[..., Any]
    activation: Any  # ActivationType.Swiglu
    # (experts,) float32 each, GPT-OSS's clamped SwiGLU; None: plain SiLU-gated
    swiglu: dict[str, torch.Tensor | None]

    @classmethod
    def create(
        cls,
        num_experts: int,
        *,
        alpha: float | None,
        limit: float | None,
        device: torch.device,
    ) -> FusedMoeCall:
        from flashinfer.fused_moe import cutlass_fused_moe
        from flashinfer.tllm_enums import ActivationType

        swiglu: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("swiglu_alpha", "swiglu_beta", "swiglu_limit")
        )
        if limit is not None:
            # gate * sigmoid(alpha * gate) * (up + beta), gate <= limit, |up| <= limit
            values = {"swiglu_alpha": alpha or 1.702, "swiglu_beta": 1.0, "swiglu_limit": limit}
            swiglu = {
                k: torch.full((num_experts,), v, dtype=torch.float32, device=device)
                for k, v in values.items()
            }
        return cls(cutlass_fused_moe, ActivationType.Swiglu, swiglu)

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        *,
        w31: torch.Tensor,
        w2: torch.Tensor,
        b31: torch.Tensor | None,
        b2: torch.Tensor | None,
    ) -> torch.Tensor:
        out = torch.empty_like(x)
        self.run(
            x.contiguous(),
            ids.to(torch.int32).contiguous(),
            weights.float().contiguous(),
            w31,
            w2,
            x.dtype,
            [],
            fc1_expert_biases=b31,
            fc2_expert_biases=b2,
            output=out,
            activation_type=self.activation,
            **self.swiglu,
        )
        return out
