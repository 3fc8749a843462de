"""FlashInfer's fused kernels (worker_service/kernels/) on a GPU, the real ones:
each op against the torch kernels in bf16 and fp16 (strided views, in-place
storage), four tiny random Llamas in bf16, a layer's fused ops captured in a CUDA
graph and replayed equal to eager, and the sampler's seeded tokens on CUDA
(FlashInfer's filters and the torch ones) against the CPU's, independent of the
batch. The CPU side of the same checks is test_fused_kernels.py.

Skips without CUDA, and without flashinfer unless RADIXSERVE_REQUIRE_FLASHINFER=1
(scripts/gpu_check.sh), as in test_flashinfer_backend.py."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.kernel_cases import (
    CPU,
    MODELS,
    VOCAB,
    check_ops,
    forward,
    qkv_views,
    sampler_batch,
    tiny_model,
)
from worker_service.kernels import Kernels, TorchKernels
from worker_service.kernels.flashinfer_kernels import FlashInferKernels
from worker_service.sampling.sampler import Sampler

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
def test_gpu_ops_match_torch(dtype: torch.dtype) -> None:
    check_ops(FlashInferKernels(), dtype, CUDA)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
def test_gpu_in_place_ops_keep_their_storage() -> None:
    fi, gen = FlashInferKernels(), torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=gen).to(CUDA, torch.bfloat16)
    res = torch.randn(5, 256, generator=gen).to(CUDA, torch.bfloat16)
    got_x, got_res = fi.add_rmsnorm(x, res, torch.ones(256, device=CUDA, dtype=x.dtype), 1e-6)
    assert got_x.data_ptr() == x.data_ptr() and got_res.data_ptr() == res.data_ptr()
    q, k, v = qkv_views(5, 4, 2, 128, torch.bfloat16, gen, CUDA)
    v_before, q_before = v.clone(), q.clone()
    cache = torch.rand(16, 128, device=CUDA)
    got_q, _ = fi.rope(torch.arange(5, device=CUDA), q, k, cache)
    assert got_q.data_ptr() == q.data_ptr() and not torch.equal(q, q_before)
    assert torch.equal(v, v_before)  # v shares the qkv buffer: untouched


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gpu_model_matches_torch(name: str) -> None:
    """bf16 on CUDA: FlashInfer's kernels against the torch ones, same weights."""

    def run(kernels: Kernels) -> tuple[torch.Tensor, ...]:
        return forward(tiny_model(name, torch.bfloat16, kernels, CUDA), CUDA)

    want, got = run(TorchKernels()), run(FlashInferKernels())
    torch.testing.assert_close(got[2], want[2], atol=3e-2, rtol=3e-2)
    for a, b in zip(got[:2], want[:2], strict=True):
        cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0)
        assert cos > 0.999, cos
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
def test_gpu_fused_ops_replay_in_a_cuda_graph() -> None:
    """A layer's worth of fused ops captured once, replayed on new inputs, equals
    the eager ops: no host sync, no allocation outside the graph's pool."""
    fi, gen = FlashInferKernels(), torch.Generator().manual_seed(4)
    bf = torch.bfloat16
    hidden, heads, kv_heads, dim = 512, 4, 2, 128
    w = (torch.rand(hidden, generator=gen) + 0.5).to(CUDA, bf)
    qk_w = (torch.rand(dim, generator=gen) + 0.5).to(CUDA, bf)
    cache = torch.rand(64, dim, generator=gen).to(CUDA)
    width = (heads + 2 * kv_heads) * dim
    static = {
        "x": torch.zeros(8, hidden, device=CUDA, dtype=bf),
        "res": torch.zeros(8, hidden, device=CUDA, dtype=bf),
        "qkv": torch.zeros(8, width, device=CUDA, dtype=bf),
        "gate_up": torch.zeros(8, 2 * hidden, device=CUDA, dtype=bf),
        "pos": torch.zeros(8, dtype=torch.long, device=CUDA),
    }

    def layer(t: dict[str, torch.Tensor]) -> torch.Tensor:
        x, res = fi.add_rmsnorm(t["x"].clone(), t["res"].clone(), w, 1e-5)
        q, k, _ = t["qkv"].clone().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q = fi.rmsnorm(q.view(8, heads, dim), qk_w, 1e-6)
        q, k = fi.rope(t["pos"], q, k.view(8, kv_heads, dim), cache)
        act = fi.silu_and_mul(t["gate_up"])
        y = fi.rmsnorm(x, w, 1e-5)
        return torch.cat([y, res, act, q.flatten(1), k.flatten(1)], dim=-1)

    def fill() -> None:
        static["x"].copy_(torch.randn(8, hidden, generator=gen).to(CUDA, bf))
        static["res"].copy_(torch.randn(8, hidden, generator=gen).to(CUDA, bf))
        static["qkv"].copy_(torch.randn(8, width, generator=gen).to(CUDA, bf))
        static["gate_up"].copy_(torch.randn(8, 2 * hidden, generator=gen).to(CUDA, bf))
        static["pos"].copy_(torch.randint(0, 64, (8,), generator=gen).to(CUDA))

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for _ in range(3):
        fill()
        graph.replay()
        torch.testing.assert_close(out, layer(static), atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
def test_gpu_sampler_agrees_with_cpu_and_ignores_the_batch() -> None:
    """Seeded tokens: FlashInfer's filters on CUDA, the torch filters on CUDA and on
    the CPU draw the same tokens from the same logits, float knife edges aside;
    and a row's token does not depend on the rows sampled with it."""
    logits, rows = sampler_batch(1024, seed=1)
    seeded = [i for i, r in enumerate(rows) if r.sampling.seed is not None]
    logits, rows = logits[seeded], [rows[i] for i in seeded]
    cpu = Sampler(VOCAB, CPU, kernels=TorchKernels()).sample(logits, rows).token_ids
    fi_sampler = Sampler(VOCAB, CUDA, kernels=FlashInferKernels())
    fused = fi_sampler.sample(logits.to(CUDA), rows).token_ids
    plain = Sampler(VOCAB, CUDA, kernels=TorchKernels()).sample(logits.to(CUDA), rows).token_ids
    for other in (fused, plain):
        differ = sum(a != b for a, b in zip(cpu, other, strict=True))
        assert differ <= max(1, len(rows) // 200), f"{differ} of {len(rows)} differ"
    for i in range(0, len(rows), 97):
        alone = fi_sampler.sample(logits[i : i + 1].to(CUDA), rows[i : i + 1]).token_ids
        assert alone == [fused[i]]
