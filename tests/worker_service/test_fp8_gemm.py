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
(``gpu``: skipped without one), where the worker uses it; there a tiny
Llama of FP8 projections runs end to end on FP8 GEMMs, against the same
checkpoint dequantized on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.fp8_quant import quantize, write_random_fp8_llama
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.worker_factory import runner_for
from worker_service.models import fp8_linear
from worker_service.models.fp8_linear import Fp8Matrix, Fp8Tensor
from worker_service.sampling.params import LogprobOptions
from worker_service.weights import fp8_checkpoint

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


def fp8_matrices(runner) -> list[object]:
    model = runner.compute.model
    return [m.quantized for m in model.modules() if getattr(m, "quantized", None) is not None]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_an_fp8_model_runs_on_fp8_gemms_on_cuda_as_dequantized_on_the_cpu(granularity, tmp_path):
    write_random_fp8_llama(tmp_path, granularity)
    prompts = prompts_of()
    results = {}
    for device in ("cuda", "cpu"):
        # No CUDA graphs: their capture would take most of this test's time.
        runner = runner_for(tmp_path, device=device, page_size=16, num_pages=64, cuda_graphs=False)
        matrices = fp8_matrices(runner)
        if device == "cuda":
            assert_all_fp8(matrices, granularity, device)
        else:
            assert matrices == []  # the float path
        results[device] = prompt_logprobs(runner, prompts)
    assert_close(results["cuda"], results["cpu"], mean=0.05)  # bf16 + FP8 activations vs fp32


def assert_all_fp8(matrices: list, granularity: str, device: str) -> None:
    """Every projection of both layers (qkv, o, gate_up, down) is FP8 on ``device``;
    fused per-tensor parts (qkv, gate_up) keep their scales as per-channel ones."""
    assert len(matrices) == 8 and all(isinstance(m, Fp8Matrix) for m in matrices)
    allowed = {"tensor", "channel"} if granularity == "tensor" else {granularity}
    assert {m.granularity for m in matrices} == allowed
    assert all(m.weight.device.type == device for m in matrices)


def prompt_logprobs(runner, prompts: list[list[int]]) -> torch.Tensor:
    """The logprob of every prompt token after the first, all prompts."""
    lp = LogprobOptions(return_logprob=True, logprob_start_len=0)
    reqs = PlanDriver(runner, 16).run([DriverRequest(p, 1, arrive=0, logprobs=lp) for p in prompts])
    return torch.tensor([v for r in reqs for i, v in sorted(r.prompt_logprobs.items()) if i > 0])


def assert_close(got: torch.Tensor, want: torch.Tensor, *, mean: float) -> None:
    assert got.shape == want.shape and len(got) > 100
    diff = (got - want).abs()
    print(f"logprob |diff|: mean {diff.mean():.4f} max {diff.max():.4f}")
    assert diff.mean() < mean and diff.max() < 10 * mean


def prompts_of() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 37, 70)]


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_the_fp8_gemm_layers_run_end_to_end_on_the_cpus_scaled_mm(
    granularity, tmp_path, monkeypatch
):
    """The layers' FP8 path (fused parts, static and dynamic activations) on
    the CPU, where the worker would dequantize: the device gate opened, torch's
    CPU ``_scaled_mm`` doing the per-tensor and rowwise GEMMs."""
    write_random_fp8_llama(tmp_path, granularity)
    prompts = prompts_of()
    want = prompt_logprobs(runner_for(tmp_path, page_size=16, num_pages=64), prompts)
    monkeypatch.setattr(fp8_checkpoint, "gemm_supported", lambda device: True)
    monkeypatch.setattr(fp8_linear, "gemm_supported", lambda device: True)
    runner = runner_for(tmp_path, page_size=16, num_pages=64)
    assert_all_fp8(fp8_matrices(runner), granularity, "cpu")
    assert_close(prompt_logprobs(runner, prompts), want, mean=0.08)
