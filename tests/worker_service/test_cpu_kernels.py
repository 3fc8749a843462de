"""The C small ops on the CPU (worker_service/kernels/c_sources/cpu_ops.c)
against the torch ones: RoPE and the residual add bit for bit, RMSNorm and
SiLU-and-mul within a few ulp, in place where the interface allows, threaded
and not; the torch fallback for layouts and dtypes they do not take; and the
choice ``select_kernels`` makes."""

from __future__ import annotations

import ctypes

import pytest
import torch

from worker_service.kernels import select_kernels
from worker_service.kernels.cpu_kernels import CpuKernels, load_cpu_kernels
from worker_service.kernels.torch_kernels import TorchKernels

CPU = torch.device("cpu")
REF = TorchKernels()
# Row counts below, at and above the size at which the C ops take threads.
ROWS = [1, 7, 16, 300]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def c_ops(request) -> CpuKernels:
    kernels = load_cpu_kernels(request.param)
    assert kernels is not None, "the C small ops must build on the CI machine (gcc is there)"
    return kernels


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-6, rtol=4e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_add_rmsnorm_in_place(c_ops, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen)
    want_x, want_res = REF.add_rmsnorm(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_res = c_ops.add_rmsnorm(x, residual, weight, 1e-5)
    assert got_x.data_ptr() == x.data_ptr() and got_res.data_ptr() == residual.data_ptr()
    assert torch.equal(got_res, want_res)  # the add is exact
    close(got_x, want_x)


@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_leaves_its_input(c_ops, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen) * 100
    before = x.clone()
    weight = torch.randn(64, generator=gen)
    close(c_ops.rmsnorm(x, weight, 1e-6), REF.rmsnorm(x, weight, 1e-6))
    assert torch.equal(x, before)  # the residual stream is an rmsnorm input: never written


@pytest.mark.parametrize("rows", ROWS)
def test_rope_on_views_of_the_fused_projection(c_ops, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=gen)
    cos_sin = torch.randn(4096, 64, generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    want_q, want_k = REF.rope(
        positions, qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64), cos_sin
    )
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    v_before = qkv[:, 768:].clone()
    got_q, got_k = c_ops.rope(positions, q, k, cos_sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where they lie
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # bit for bit
    assert torch.equal(qkv[:, 768:], v_before)  # v untouched


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(c_ops, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])  # exp's clamps, silu(0)
    got = c_ops.silu_and_mul(gate_up)
    want = REF.silu_and_mul(gate_up)
    assert got.shape == (rows, 1536)
    close(got, want)
    assert torch.isfinite(got).all()


def test_other_layouts_and_dtypes_fall_back_to_torch(c_ops) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(c_ops.rmsnorm(x, w, 1e-6), REF.rmsnorm(x, w, 1e-6))
    strided = torch.randn(64, 8, generator=gen).t()  # not contiguous
    assert torch.equal(
        c_ops.rmsnorm(strided, torch.ones(64), 1e-6), REF.rmsnorm(strided, torch.ones(64), 1e-6)
    )
    # Heads not contiguous within a token: (T, D, H) transposed to (T, H, D).
    q = torch.randn(4, 64, 2, generator=gen).transpose(1, 2)
    k = torch.randn(4, 64, 1, generator=gen).transpose(1, 2)
    pos, cs = torch.arange(4), torch.randn(16, 64, generator=gen)
    want = REF.rope(pos, q.clone(), k.clone(), cs)
    got = c_ops.rope(pos, q, k, cs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="differ"):
        c_ops.add_rmsnorm(torch.zeros(2, 64), torch.zeros(3, 64), torch.ones(64), 1e-6)


def test_select_kernels_on_the_cpu() -> None:
    assert select_kernels(CPU, torch.float32).name == "cpu"  # auto, a float32 model
    assert select_kernels(CPU, torch.float32, "torch").name == "torch"
    assert select_kernels(CPU, torch.bfloat16).name == "torch"  # auto: float32 only
    assert select_kernels(CPU).name == "torch"  # the sampler's
    assert select_kernels(CPU, None, "cpu").name == "torch"
    with pytest.raises(ValueError, match="float32"):
        select_kernels(CPU, torch.bfloat16, "cpu")


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_cpu_kernels(1) is None
    assert select_kernels(CPU, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="did not build"):
        select_kernels(CPU, torch.float32, "cpu")


def test_a_failed_openmp_build_falls_back_to_one_thread(monkeypatch, tmp_path) -> None:
    """A compiler without libgomp's development files fails -fopenmp: the plain
    build runs instead (one thread), not the torch ops."""
    from worker_service.kernels import c_build

    real = c_build.build_library

    def no_openmp(source, flags, stem, directory=None):
        if c_build.OPENMP_FLAG in flags:
            raise RuntimeError("building cpu_ops.c failed: cannot find -lgomp")
        return real(source, flags, stem, tmp_path)

    monkeypatch.setattr(c_build, "build_library", no_openmp)
    monkeypatch.setattr(c_build, "torch_uses_openmp", lambda: True)
    kernels = load_cpu_kernels(2)
    assert kernels is not None and "-omp" not in kernels.library.name
    x, residual, weight = torch.randn(3, 4, 64).unbind(0)
    want = REF.add_rmsnorm(x.clone(), residual.clone(), weight[0], 1e-6)
    got = kernels.add_rmsnorm(x, residual, weight[0], 1e-6)
    close(got[0], want[0])


def test_a_changed_header_rebuilds(tmp_path) -> None:
    """A build's key covers the local headers the source includes (and
    theirs): editing one builds a new library instead of loading the old."""
    from worker_service.kernels.c_build import CFLAGS, build_library

    (tmp_path / "inner.h").write_text("enum { VALUE = 1 };\n")
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    source = tmp_path / "lib.c"
    source.write_text('#include "outer.h"\nint value(void) { return VALUE; }\n')
    first = build_library(source, list(CFLAGS), "lib", tmp_path / "built")
    assert build_library(source, list(CFLAGS), "lib", tmp_path / "built") == first
    (tmp_path / "inner.h").write_text("enum { VALUE = 2 };\n")
    second = build_library(source, list(CFLAGS), "lib", tmp_path / "built")
    assert second != first
    assert ctypes.CDLL(str(first)).value() == 1 and ctypes.CDLL(str(second)).value() == 2
