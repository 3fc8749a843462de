"""Grammar masks on a GPU without a compiler: xgrammar's default CUDA path ("triton")
compiles a kernel at first use, which the CUDA image (no C compiler) cannot. The
sampler decides once, at start, on "torch" (a few torch ops of ours) for every device
but the CPU; here it must give xgrammar's CPU masked logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from worker_service.kernels import TorchKernels
from worker_service.sampling import grammar
from worker_service.sampling.sampler import Sampler

pytest.importorskip("xgrammar")


def test_the_choice_compiles_nothing_on_a_gpu() -> None:
    assert grammar.bitmask_backend("cpu") == "cpu"
    for device_type in ("cuda", "xpu", "meta"):
        assert grammar.bitmask_backend(device_type) == "torch"


def test_the_sampler_decides_once_for_its_device() -> None:
    torch_kernels = TorchKernels()
    assert Sampler(96, torch.device("cpu"), kernels=torch_kernels).bitmask_backend == "cpu"
    gpu = Sampler(96, torch.device("cuda"), kernels=torch_kernels)
    assert gpu.bitmask_backend == "torch"


@pytest.mark.parametrize("vocab", [1000, 1024, 97])
def test_the_torch_path_masks_like_xgrammars_cpu_path(vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows, constrained = 5, [0, 2, 3]
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = grammar.allocate_bitmask(rows, vocab)
    words = bitmask.shape[1]
    # Random words, the sign bit (token 31 of a word) set in about half of them.
    bitmask.copy_(torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64))
    cpu, ours = logits.clone(), logits.clone()
    grammar.apply_bitmask(cpu, bitmask, constrained, backend="cpu")
    grammar.apply_bitmask(ours, bitmask, constrained, backend="torch")
    assert torch.equal(cpu, ours)
    masked = torch.isinf(cpu)
    assert masked[constrained].any() and not masked[[1, 4]].any()
    # Token t of a row is allowed iff bit t % 32 of word t // 32 is set.
    t = torch.arange(vocab)
    allowed = (bitmask[:, t // 32] >> (t % 32)) & 1 == 1
    assert torch.equal(masked[constrained], ~allowed[constrained])
    with pytest.raises(ValueError, match="triton"):
        grammar.apply_bitmask(ours, bitmask, constrained, backend="triton")
