"""The kernel ops of the Gemma family (Gemma's RMSNorm, plain and after the
residual add, and GeGLU) in each kernel set: torch (transformers'
arithmetic), the C ops on the CPU (within a few ulp, the norm in place), and
FlashInfer's through its public functions replaced by references written from
its documentation (flashinfer_fakes.py); and Phi-3's longrope table past the
original context."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.worker_service.support import flashinfer_fakes as fakes
from worker_service.attention.flashinfer_modules import (
    GEGLU_OP_MODULE,
    OP_MODULES,
    model_op_modules,
)
from worker_service.kernels.cpu_kernels import load_cpu_kernels
from worker_service.kernels.flashinfer_kernels import FlashInferKernels
from worker_service.kernels.torch_kernels import TorchKernels
from worker_service.models.config import ModelConfig, RopeConfig
from worker_service.models.rope import RotaryEmbedding

REF = TorchKernels()
EPS = 1e-6


def gemma_norm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma3RMSNorm.forward, line for line."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).type_as(x)


def inputs(dtype: torch.dtype, rows: int = 9, dim: int = 64):
    g = torch.Generator().manual_seed(rows * dim)
    x, residual = (torch.randn(2, rows, dim, generator=g) * 3).to(dtype)
    w = (torch.randn(dim, generator=g) * 0.5).to(dtype)
    return x, residual, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_gemma_norms_are_transformers_arithmetic(dtype):
    x, residual, w = inputs(dtype)
    assert torch.equal(REF.gemma_rmsnorm(x, w, EPS), gemma_norm_reference(x, w))
    normed, total = REF.gemma_add_rmsnorm(x, residual, w, EPS)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, gemma_norm_reference(residual + x, w))
    if dtype == torch.bfloat16:
        # Folding 1 + w into a bf16 weight and norming Llama's way rounds three
        # times: not the same numbers, hence ops of their own.
        folded = REF.rmsnorm(x, (1.0 + w.float()).to(dtype), EPS)
        assert not torch.equal(folded, gemma_norm_reference(x, w))


def test_torch_geglu_is_tanh_gelu_times_up():
    gate_up = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(1)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(REF.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("rows", [1, 300])
def test_cpu_gemma_norms_within_ulps_and_in_place(rows):
    c_ops = load_cpu_kernels(1)
    assert c_ops is not None, "the C small ops must build on the CI machine (gcc is there)"
    x, residual, w = inputs(torch.float32, rows=rows, dim=576)
    close = {"atol": 1e-6, "rtol": 4e-6}
    torch.testing.assert_close(c_ops.gemma_rmsnorm(x, w, EPS), gemma_norm_reference(x, w), **close)
    want = gemma_norm_reference(residual + x, w)
    want_total = residual + x
    got, total = c_ops.gemma_add_rmsnorm(x, residual, w, EPS)
    assert got.data_ptr() == x.data_ptr() and total.data_ptr() == residual.data_ptr()
    assert torch.equal(total, want_total)
    torch.testing.assert_close(got, want, **close)
    heads = torch.randn(rows, 4, 16)  # the (T, H, D) query/key norm
    hw = torch.randn(16)
    torch.testing.assert_close(
        c_ops.gemma_rmsnorm(heads, hw, EPS), gemma_norm_reference(heads, hw), **close
    )


@pytest.mark.parametrize("rows", [1, 1200])
def test_cpu_geglu_within_ulps(rows):
    c_ops = load_cpu_kernels(2)
    assert c_ops is not None
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 64, generator=g) * 4
    gate_up[0, :8] = torch.tensor([-100.0, -12.0, -5.0, -0.5, 0.0, 0.5, 5.0, 100.0])
    got, want = c_ops.gelu_tanh_and_mul(gate_up), REF.gelu_tanh_and_mul(gate_up)
    # Near x = -5 torch's 1 + tanh(z) cancels to 0 where the C form keeps
    # ~1e-7 * up; elsewhere a few ulp apart. Against float64, no worse.
    torch.testing.assert_close(got, want, atol=2e-6, rtol=4e-6)
    x, up = gate_up.double().chunk(2, dim=-1)
    exact = 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3))) * up
    assert (got - exact).abs().max() <= (want - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flashinfer_gemma_ops_match_torch(dtype, monkeypatch):
    pytest.importorskip("flashinfer")
    fakes.install_api(monkeypatch)
    fi = FlashInferKernels()
    x, residual, w = inputs(dtype)
    # FlashInfer rounds once from float32, as transformers' Gemma norm does.
    assert torch.equal(fi.gemma_rmsnorm(x, w, EPS), REF.gemma_rmsnorm(x, w, EPS))
    want, want_total = REF.gemma_add_rmsnorm(x, residual, w, EPS)
    got, total = fi.gemma_add_rmsnorm(x.clone(), residual.clone(), w, EPS)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(got, want, atol=0, rtol=0 if dtype == torch.float32 else 8e-3)
    # Gemma 3's query norm on a strided (T, H, D) view of a fused projection.
    qkv = (torch.randn(5, 3 * 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    q = qkv[:, :64].view(5, 4, 16)
    hw = w[:16]
    assert torch.equal(fi.gemma_rmsnorm(q, hw, EPS), REF.gemma_rmsnorm(q, hw, EPS))
    gate_up = (torch.randn(7, 96, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    torch.testing.assert_close(
        fi.gelu_tanh_and_mul(gate_up),
        REF.gelu_tanh_and_mul(gate_up),
        atol=1e-5 if dtype == torch.float32 else 1e-2,
        rtol=1e-5 if dtype == torch.float32 else 8e-3,
    )


def test_longrope_uses_the_long_factors_from_the_original_context_on():
    short = tuple(1.0 + i / 10 for i in range(8))
    long = tuple(2.0 + i for i in range(8))
    rope = RopeConfig(
        theta=10000.0,
        scaling_type="longrope",
        factor=4.0,
        original_max_position_embeddings=64,
        short_factor=short,
        long_factor=long,
    )
    cfg = ModelConfig("Phi3ForCausalLM", 64, 128, 1, 4, 4, 16, 256, rope=rope,
                      max_position_embeddings=256)  # fmt: skip
    table = RotaryEmbedding(cfg, torch.device("cpu"), REF).cos_sin_cache
    scale = math.sqrt(1 + math.log(4.0) / math.log(64))

    def rows(factors, positions):
        shape = torch.arange(0, 16, 2, dtype=torch.int64).float() / 16
        inv = 1.0 / (torch.tensor(factors) * 10000.0**shape)
        freqs = torch.outer(torch.tensor(positions, dtype=torch.float32), inv)
        return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)

    assert torch.equal(table[[0, 5, 63]], rows(short, [0, 5, 63]))
    assert torch.equal(table[[64, 200, 255]], rows(long, [64, 200, 255]))


def test_only_a_geglu_model_needs_flashinfers_geglu_module():
    # A Llama worker started against a bundle built before GeGLU still starts.
    assert GEGLU_OP_MODULE in OP_MODULES  # built into the bundle
    assert model_op_modules("gelu_pytorch_tanh") == ("norm", "rope", GEGLU_OP_MODULE)
    assert GEGLU_OP_MODULE not in model_op_modules("silu")
