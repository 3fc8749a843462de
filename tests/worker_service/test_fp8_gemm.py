"""The FP8 GEMM path (models/fp8_linear.py: Fp8Matrix.matmul) against the
formats' definitions: activations quantized to E4M3 per token (amax / 448,
per 128-column group for block weights, capped by fbgemm's upper bound) or
with the checkpoint's static input_scale, multiplied by the FP8 weight with
its scales.

Two references: the same computation written out here in float (the
quantized activations dequantized, times the dequantized weight): tight, it
catches a wrong scale, a wrong rounding or a static scale ignored; and the
plain float matmul x @ W^T: loose (FP8 activations lose ~3 bits).

The per-tensor and rowwise forms run on the CPU through torch's own CPU
``_scaled_mm``; every form, the 128x128 blocks among them, runs on CUDA
(``gpu``: skipped without one), where the worker uses it.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.fp8_checkpoints import quantize
from worker_service.models.fp8_linear import Fp8Matrix, Fp8Tensor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3_MAX = 448.0

FORMS = [
    ("tensor", "dynamic", None),
    ("tensor", "static", None),
    ("channel", "dynamic", None),
    ("channel", "dynamic", 2.0),  # fbgemm's cap on the activation amax, reached
    ("channel", "static", None),
    ("block", "dynamic", None),
]
IDS = [
    "tensor-dynamic",
    "tensor-static",
    "channel-dynamic",
    "channel-ub",
    "channel-static",
    "block",
]


def weight(granularity: str, activations: str, ub: float | None) -> Fp8Tensor:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(384, 256, generator=g) * torch.linspace(0.05, 3.0, 384)[:, None]
    q, scale = quantize(w, granularity)
    # Large enough for the largest activation (~40): none is clipped.
    input_scale = torch.tensor(0.1) if activations == "static" else None
    return Fp8Tensor("w", q, scale, granularity, activations, input_scale, ub)


def activations(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    # Tokens of very different magnitudes: a per-tensor scale where a per-token
    # one is due shows.
    return torch.randn(rows, 256, generator=g) * torch.logspace(-1, 1, rows)[:, None]


def by_definition(x: torch.Tensor, t: Fp8Tensor) -> torch.Tensor:
    """The FP8 product in float: each activation group rounded to E4M3 under
    its scale, times the dequantized weight."""
    x = x.float()
    if t.activations == "static":
        s = t.input_scale
        xq = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    else:
        group = 128 if t.granularity == "block" else x.shape[1]
        groups = x.reshape(x.shape[0], -1, group)
        amax = groups.abs().amax(-1, keepdim=True)
        if t.activation_ub is not None:
            amax = torch.minimum(amax, torch.tensor(t.activation_ub))
        s = amax / E4M3_MAX
        q = (groups / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
        xq = (q * s).reshape(x.shape)
    return xq @ t.dequantize().t()


def check(t: Fp8Tensor, device: torch.device, dtype: torch.dtype, tight: float) -> None:
    matrix = t.fp8_matrix(device)
    assert isinstance(matrix, Fp8Matrix) and matrix.weight.dtype == torch.float8_e4m3fn
    for rows in (1, 7, 64):
        x = activations(rows)
        got = matrix.matmul(x.to(device, dtype))
        assert got.dtype == dtype and got.shape == (rows, 384)
        got = got.float().cpu()
        want = by_definition(x.to(dtype), t)
        scale = want.abs().amax(dim=1, keepdim=True)
        assert ((got - want).abs() / scale).max() < tight
        # Against the unquantized float matmul: FP8 activations' error only
        # (the capped form clips on purpose).
        if t.activation_ub is None:
            exact = x.to(dtype).float() @ t.dequantize().t()
            assert ((got - exact).abs() / scale).max() < 0.08


@pytest.mark.parametrize(("granularity", "acts", "ub"), FORMS[:5], ids=IDS[:5])
def test_fp8_gemm_on_the_cpu_follows_the_definition(granularity, acts, ub):
    check(weight(granularity, acts, ub), torch.device("cpu"), torch.float32, tight=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("granularity", "acts", "ub"), FORMS, ids=IDS)
def test_fp8_gemm_on_cuda_follows_the_definition(granularity, acts, ub):
    # bf16 output: the GEMM's own rounding, ~2^-8 of the row's largest value.
    check(weight(granularity, acts, ub), torch.device("cuda"), torch.bfloat16, tight=1e-2)
