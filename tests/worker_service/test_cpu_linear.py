"""The projections' packed CPU paths (models/cpu_linear.py): the C kernel for
steps of few rows (kernels/c_sources/skinny_linear.c) and oneDNN past them,
against F.linear over the shapes that exercise the kernel's tiles (rows not a
multiple of 8, outputs not a multiple of 16 or of a block pair), with and
without bias, on one thread and several."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_service.kernels.cpu_kernels import load_skinny_linear
from worker_service.models import cpu_linear


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, cpu_linear.SKINNY_MAX_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (40, 24), (7, 5), (49, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_kernel_matches_f_linear(threads, rows, out_features, in_features, bias) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    packed = cpu_linear.pack(weight)
    assert packed is not None and packed.skinny is not None, "gcc is on the CI machine"
    assert packed.kernel is not None and packed.kernel.threads == threads
    assert packed.skinny.data_ptr() % 64 == 0
    got = cpu_linear.linear(x, packed, b)
    # sums of up to 576 products of about 1 in another order: float32 rounding
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


def test_long_steps_take_onednn_and_agree(threads) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    packed = cpu_linear.pack(weight)
    rows = cpu_linear.SKINNY_MAX_ROWS + 1
    x = torch.randn(rows, 64, generator=gen)
    want = F.linear(x, weight)
    torch.testing.assert_close(cpu_linear.linear(x, packed, None), want, atol=2e-5, rtol=2e-5)
    # the same rows one short step at a time (the C kernel) give the same numbers
    short = torch.cat([cpu_linear.linear(x[i : i + 1], packed, None) for i in range(rows)])
    torch.testing.assert_close(short, want, atol=2e-5, rtol=2e-5)


def test_threads_do_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3072, 576, generator=gen)
    x = torch.randn(16, 576, generator=gen)
    one, two = load_skinny_linear(1), load_skinny_linear(2)
    assert one is not None and two is not None
    packed = one.pack(weight)
    assert torch.equal(one(x, packed, 3072, None), two(x, packed, 3072, None))


def test_bf16_weights_keep_onednn_only() -> None:
    """Packed for oneDNN only where the CPU has bf16 support (its reorder
    raises without it: the weight then stays plain, served by F.linear)."""
    weight = torch.randn(32, 16).to(torch.bfloat16)
    packed = cpu_linear.pack(weight)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is None
        return
    assert packed is not None and packed.skinny is None
    x = torch.randn(2, 16).to(torch.bfloat16)
    torch.testing.assert_close(
        cpu_linear.linear(x, packed, None).float(), F.linear(x, weight).float(), atol=0.1, rtol=0.05
    )


def test_a_packed_weight_of_another_shape_is_refused() -> None:
    kernel = load_skinny_linear(1)
    packed = kernel.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match="not"):
        kernel(torch.randn(2, 24), packed, 32, None)
