"""The small ops of the model (RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-mul)
and the sampler's top-k / top-p / min-p filter, in two implementations behind
one interface (``base.Kernels``):

- ``torch_kernels.TorchKernels``: plain torch, the CPU path and the reference
  (the Hugging Face arithmetic, bit for bit);
- ``flashinfer_kernels.FlashInferKernels``: FlashInfer's fused kernels, one
  launch per op instead of a handful (CUDA; the model's ops need fp16/bf16);
- ``cpu_kernels.CpuKernels``: the model's ops in C on the CPU (float32), one
  call per op instead of a handful, built on the host (c_build.py); within a
  few ulp of the torch ones.

``select_kernels`` below is the one place that decides which runs. The
package imports without FlashInfer; it is imported only when chosen.
"""

from __future__ import annotations

import structlog
import torch

from worker_service.kernels.base import Kernels, SamplingFilters
from worker_service.kernels.torch_kernels import TorchKernels

__all__ = ["KERNEL_CHOICES", "Kernels", "SamplingFilters", "TorchKernels", "select_kernels"]

logger = structlog.get_logger(__name__)

KERNEL_CHOICES = ("auto", "torch", "flashinfer", "cpu")
_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def select_kernels(
    device: torch.device | str, dtype: torch.dtype | None = None, choice: str = "auto"
) -> Kernels:
    """The kernels for tensors on ``device``; ``dtype`` is the model's (None for the
    sampler, whose FlashInfer kernels take float32 probabilities).

    "auto": FlashInfer's on CUDA when the dtype suits them and flashinfer imports,
    the C ones for a float32 model on the CPU when they build, torch otherwise;
    "torch" always; "flashinfer" or "cpu", or an error saying why not.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, not {choice!r}")
    if choice == "torch":
        return TorchKernels()
    device = torch.device(device)
    if device.type == "cpu" and choice in ("auto", "cpu"):
        return _cpu_kernels(dtype, choice)
    why_not = None
    if device.type != "cuda":
        why_not = f"FlashInfer's kernels run on CUDA, not {device.type}"
    elif dtype is not None and dtype not in _FUSED_DTYPES:
        why_not = f"FlashInfer's norm, RoPE and activation kernels take fp16/bf16, not {dtype}"
    else:
        try:
            from worker_service.kernels.flashinfer_kernels import FlashInferKernels

            return FlashInferKernels()
        except ImportError as e:
            why_not = f"flashinfer is not importable ({e})"
    if choice == "flashinfer":
        raise ValueError(why_not)
    if device.type == "cuda":
        logger.info("using the torch kernels", reason=why_not)
    return TorchKernels()


def _cpu_kernels(dtype: torch.dtype | None, choice: str) -> Kernels:
    """The C small ops for a float32 model; the sampler (dtype None: its filter
    is the torch one in either set) gets the torch ones, as do other dtypes
    under "auto"."""
    if dtype is None:
        return TorchKernels()
    if dtype == torch.float32:
        from worker_service.kernels.cpu_kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None:
            return kernels
        why_not = "the C small ops did not build (the log says why)"
    else:
        why_not = f"the C small ops take a float32 model, not {dtype}"
    if choice == "cpu":
        raise ValueError(why_not)
    return TorchKernels()
