"""FlashInfer over an fp8 e4m3 KV cache on a GPU (scripts/gpu_check.sh runs these):
decode (CUDA-core and tensor-core) and prefill against TorchAttention over a
float32 cache holding the fp8 cache's dequantized values (within the bf16
tolerance, the fp8 bytes identical to what KvCache.write stores), and captured
decode graphs equal to eager steps.

The fp8-KV modules are not in the default bundle (its 64 MiB:
flashinfer_modules.py); where they are neither prebuilt nor compilable the
tests skip, naming the rebuild (FI_FP8KV_DTYPES="bfloat16" FI_FP8KV_HEAD_DIMS="128")."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from tests.worker_service.support.attention_batches import BATCHES, make_batch, spec_for
from worker_service.attention.base import AttentionSpec
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import FP8_E4M3, KvScales, dequantize_fp8, quantize_fp8
from worker_service.execution.cuda_graphs import DecodeGraphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, needs_cuda]

HEADS = [(4, 4, 128), (8, 2, 128)]  # group 1: CUDA-core decode; 4: tensor-core decode
SCALES = KvScales((0.5, 1.75), (2.0, 0.375), "checkpoint")
TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture
def fp8_modules(flashinfer_ok) -> None:
    from worker_service.attention.flashinfer_modules import (
        FP8_KV_DTYPE,
        KernelsNotPrebuilt,
        check_prebuilt,
        flashinfer_kernel_source,
        needed_modules,
    )

    needed = [
        m
        for group in (1, 4)
        for window in (False, True)
        for m in needed_modules(
            "bfloat16", 128, group=group, sliding_window=window, kv_dtype=FP8_KV_DTYPE
        )
    ]
    try:
        check_prebuilt(needed, [], flashinfer_kernel_source())
    except KernelsNotPrebuilt as e:
        pytest.skip(f"fp8-KV modules not prebuilt here: {str(e).splitlines()[0]}")


def fp8_caches(
    spec: AttentionSpec, num_pages: int, gen: torch.Generator
) -> tuple[KvCache, KvCache]:
    """An fp8 cache with random contents and a float32 cache of its values."""
    shape = {
        "num_layers": 2,
        "num_pages": num_pages,
        "page_size": spec.page_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "device": "cuda",
    }
    fp8 = KvCache(**shape, dtype=FP8_E4M3, compute_dtype=spec.dtype, scales=SCALES)
    ref = KvCache(**shape, dtype=torch.float32)
    for layer, (a, b) in enumerate(zip(fp8.layers, ref.layers, strict=True)):
        for which, scale in ((0, SCALES.k[layer]), (1, SCALES.v[layer])):
            a[:, which] = quantize_fp8(torch.randn(a[:, which].shape, generator=gen), scale).cuda()
            b[:, which] = dequantize_fp8(a[:, which], scale, torch.float32)
    return fp8, ref


def qkv(spec: AttentionSpec, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    heads = [spec.num_heads, spec.num_kv_heads, spec.num_kv_heads]
    return [
        torch.randn(tokens, h, spec.head_dim, generator=gen).to("cuda", spec.dtype) for h in heads
    ]


@pytest.mark.usefixtures("fp8_modules")
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_fp8_kv_flashinfer_matches_the_float_reference(heads, window, kind) -> None:
    page_size = 16
    spec = dataclasses.replace(
        spec_for(heads, page_size, window, torch.bfloat16, "cuda"), kv_dtype=FP8_E4M3
    )
    ref_spec = spec_for(heads, page_size, window, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("fp8", heads, window, kind)).encode()))
    num_pages = 4096 // page_size
    batch = make_batch(*BATCHES[kind], page_size, num_pages, gen, table_device="cuda")
    fp8_kv, ref_kv = fp8_caches(spec, num_pages, gen)
    fi = FlashInferAttention(spec, workspace_bytes=64 * 2**20)
    ref = TorchAttention(ref_spec)
    fi.begin_step(batch)
    ref.begin_step(batch)
    for layer in range(2):
        q, k, v = qkv(spec, batch.num_tokens, gen)
        out = fi.forward(layer, q, k, v, kv=fp8_kv)
        # The reference stores what the fp8 cache reads back.
        k_read = dequantize_fp8(quantize_fp8(k, SCALES.k[layer]), SCALES.k[layer], torch.float32)
        v_read = dequantize_fp8(quantize_fp8(v, SCALES.v[layer]), SCALES.v[layer], torch.float32)
        expected = ref.forward(layer, q.float(), k_read, v_read, kv=ref_kv)
        stored = fp8_kv.layers[layer]
        assert torch.equal(
            dequantize_fp8(stored[:, 0], SCALES.k[layer], torch.float32), ref_kv.layers[layer][:, 0]
        )
        assert torch.equal(
            dequantize_fp8(stored[:, 1], SCALES.v[layer], torch.float32), ref_kv.layers[layer][:, 1]
        )
        torch.testing.assert_close(out.float(), expected, **TOL)


@pytest.mark.usefixtures("fp8_modules")
@pytest.mark.parametrize("heads", HEADS)
def test_fp8_kv_graph_decode_equals_eager(heads) -> None:
    page_size = 16
    spec = dataclasses.replace(
        spec_for(heads, page_size, None, torch.bfloat16, "cuda"), kv_dtype=FP8_E4M3
    )
    gen = torch.Generator().manual_seed(11)
    num_pages = 2048 // page_size
    scratch = num_pages - 1
    graph_kv, _ = fp8_caches(spec, num_pages, gen)
    eager_kv, _ = fp8_caches(spec, num_pages, gen)
    for a, b in zip(graph_kv.layers, eager_kv.layers, strict=True):
        b.view(torch.uint8).copy_(a.view(torch.uint8))
    graphed = FlashInferAttention(spec, workspace_bytes=64 * 2**20)
    graphed.enable_decode_graphs(scratch, -(-200 // page_size), sizes=(1, 2, 4, 8))
    eager = FlashInferAttention(spec, workspace_bytes=64 * 2**20)
    bufs = dict(zip("qkv", qkv(spec, 8, gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = [graphed.forward(i, x["q"], x["k"], x["v"], kv=graph_kv) for i in range(2)]
        return torch.stack(outs, dim=1)

    graphs = DecodeGraphs(graphed, forward, bufs, page_size)
    graphs.capture()
    for decodes in ([40, 3, 17], [1, 2, 3, 4, 5, 6, 7, 150]):
        batch = make_batch([], decodes, page_size, num_pages, gen, "cuda")
        q, k, v = qkv(spec, len(decodes), gen)
        out = graphs.replay(batch, {"q": q, "k": k, "v": v})
        assert out is not None
        eager.begin_step(batch)
        expected = torch.stack([eager.forward(i, q, k, v, kv=eager_kv) for i in range(2)], 1)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        for a, b in zip(graph_kv.layers, eager_kv.layers, strict=True):
            assert torch.equal(a[:scratch].view(torch.uint8), b[:scratch].view(torch.uint8))
