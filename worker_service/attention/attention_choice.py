"""Which attention backend a worker runs, decided once at start from its
``--attention-backend``, device, dtype and the model's head dim (pure: the
CPU tests pin every case).

``auto`` is FlashInfer on CUDA where FlashInfer's kernels are right for the
model, else the torch backend, with the reason logged: FlashInfer has no fp32
attention kernels, and its FA2 kernels take head dims that are multiples of 64
only (flashinfer_modules.py says why), and no attention sinks (GPT-OSS): the
installed FlashInfer (0.7.2) takes ``sinks`` in its wrappers' ``run`` but its
FA2 modules, the ones we build and ship, drop them without a word (only the
trtllm-gen kernels, Blackwell cubins we do not ship, read them), so a sink
model on CUDA runs the torch backend, said at start. An explicit ``flashinfer`` that cannot
work stops the worker at start with what to do instead, rather than failing in
graph capture or computing garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention.flashinfer_modules import FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS

ATTENTION_CHOICES = ("auto", "torch", "flashinfer")


@dataclass(frozen=True)
class AttentionChoice:
    name: str  # "flashinfer" or "torch"
    reason: str | None = None  # why "auto" passed FlashInfer over on CUDA


class AttentionRefused(SystemExit):
    """The worker stops at start: the asked-for backend cannot run this model."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


SINKS_UNSUPPORTED = (
    "FlashInfer's FA2 attention kernels ignore attention sinks (only its trtllm-gen "
    "kernels read them, and those are not built here), so this model's attention "
    "would be wrong"
)


def flashinfer_unfit(dtype: torch.dtype, head_dim: int, *, sinks: bool = False) -> str | None:
    """Why FlashInfer's attention cannot run this model, or None if it can."""
    if sinks:
        return SINKS_UNSUPPORTED
    if dtype_name(dtype) not in FLASHINFER_DTYPES:
        return f"FlashInfer has no {dtype_name(dtype)} attention kernels (only {FLASHINFER_DTYPES})"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return (
            f"FlashInfer's FA2 attention kernels are wrong or crash for head dim {head_dim} "
            f"(they take {', '.join(map(str, FLASHINFER_HEAD_DIMS))}: multiples of 64)"
        )
    return None


def choose_attention(
    requested: str, *, device_type: str, dtype: torch.dtype, head_dim: int, sinks: bool = False
) -> AttentionChoice:
    """``sinks``: the model has attention sinks (ModelConfig.attention_sinks)."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention backend must be one of {ATTENTION_CHOICES}, not {requested!r}")
    if requested == "torch":
        return AttentionChoice("torch")
    if device_type != "cuda":
        if requested == "flashinfer":
            raise AttentionRefused(
                f"--attention-backend flashinfer needs --device cuda (not {device_type}); "
                "use --attention-backend torch or auto"
            )
        return AttentionChoice("torch")
    why_not = flashinfer_unfit(dtype, head_dim, sinks=sinks)
    if why_not is None:
        return AttentionChoice("flashinfer")
    if requested == "flashinfer":
        fix = (
            "use --dtype bfloat16 or float16"
            if dtype_name(dtype) not in FLASHINFER_DTYPES and not sinks
            else "this model needs another backend"
        )
        raise AttentionRefused(
            f"--attention-backend flashinfer cannot run this model: {why_not}; {fix}, or "
            "--attention-backend torch (or auto, which picks it)"
        )
    return AttentionChoice("torch", why_not)
