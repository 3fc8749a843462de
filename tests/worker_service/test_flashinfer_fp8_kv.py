"""FlashInfer over an fp8 e4m3 KV cache, on the CPU: our ``FlashInferAttention``
with ``kv_dtype`` float8_e4m3fn drives FlashInfer's real wrappers (plan with
``kv_data_type``, run with the layer's ``k_scale``, which the wrappers fold
into sm_scale; the output times the layer's ``v_scale``) over torch stand-ins for the
compiled kernels (flashinfer_cpu_harness.py), and must agree with
``TorchAttention`` over the same fp8 cache: KV caches byte-identical (both
quantize with the layer's scales), outputs within the bf16 tolerance; eagerly
on the GPU tests' grid, and through captured decode graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import BATCHES, HEADS, make_batch, spec_for
from tests.worker_service.support.flashinfer_conformance import (
    GRAPH_SIZES,
    LAYERS,
    TOL,
    eager_outputs,
    like_the_runner,
    random_qkv,
    seed,
)
from worker_service.attention.base import AttentionSpec
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import FP8_E4M3, KvScales, quantize_fp8
from worker_service.execution.cuda_graphs import DecodeGraphs

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer-python is not installed (make setup installs it without CUDA deps)",
)

# Per layer, far from 1 so that a scale left out or applied twice shows.
SCALES = KvScales((0.5, 1.75), (2.0, 0.375), "checkpoint")


def fp8_spec(spec: AttentionSpec) -> AttentionSpec:
    return dataclasses.replace(spec, kv_dtype=FP8_E4M3)


def fp8_caches(
    spec: AttentionSpec, num_pages: int, gen: torch.Generator
) -> tuple[KvCache, KvCache]:
    """Two fp8 caches with the same random bytes: FlashInfer's (reads in bf16)
    and TorchAttention's (reads in float32)."""
    shape = {
        "num_layers": LAYERS,
        "num_pages": num_pages,
        "page_size": spec.page_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "device": "cpu",
        "dtype": FP8_E4M3,
        "scales": SCALES,
    }
    fi = KvCache(**shape, compute_dtype=spec.dtype)
    ref = KvCache(**shape, compute_dtype=torch.float32)
    for layer, (a, b) in enumerate(zip(fi.layers, ref.layers, strict=True)):
        a[:, 0] = quantize_fp8(torch.randn(a[:, 0].shape, generator=gen), SCALES.k[layer])
        a[:, 1] = quantize_fp8(torch.randn(a[:, 1].shape, generator=gen), SCALES.v[layer])
        b.view(torch.uint8).copy_(a.view(torch.uint8))
    return fi, ref


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_fp8_kv_conforms_on_the_gpu_grid(heads, window, kind) -> None:
    page_size = 16
    gen = seed("fp8", heads, window, kind)
    num_pages = 512 // page_size
    batch = like_the_runner(make_batch(*BATCHES[kind], page_size, num_pages, gen))
    spec = fp8_spec(spec_for(heads, page_size, window, torch.bfloat16, "cpu"))
    fi = FlashInferAttention(spec, workspace_bytes=2**20)
    ref = TorchAttention(fp8_spec(spec_for(heads, page_size, window, torch.float32, "cpu")))
    fi_kv, ref_kv = fp8_caches(spec, num_pages, gen)
    fi.begin_step(batch)
    ref.begin_step(batch)
    for layer in range(LAYERS):
        q, k, v = random_qkv(spec, batch.num_tokens, gen)
        out = fi.forward(layer, q, k, v, kv=fi_kv)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), kv=ref_kv)
        assert fi_kv.layers[layer].dtype == FP8_E4M3
        assert same_bytes(fi_kv.layers[layer], ref_kv.layers[layer]), "KV cache differs"
        torch.testing.assert_close(out.float(), expected, **TOL)
    group = heads[0] // heads[1]
    _, decodes = BATCHES[kind]
    assert reference.CALLS["decode.run"] == LAYERS * (bool(decodes) and group < 4)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128)])  # CUDA-core and tensor-core decode
def test_fp8_kv_graph_decode_conforms(monkeypatch, heads) -> None:
    """Captured decode graphs over an fp8 cache: the scales are baked into the
    captured launches per layer, and replays equal TorchAttention's steps."""
    page_size, window = 16, None
    harness.install_graph_stand_ins(monkeypatch)
    gen = seed("fp8 graphs", heads)
    num_pages = 512 // page_size
    scratch = num_pages - 1
    spec = fp8_spec(spec_for(heads, page_size, window, torch.bfloat16, "cpu"))
    graph_kv, ref_kv = fp8_caches(spec, num_pages, gen)
    graphed = FlashInferAttention(spec, workspace_bytes=2**20)
    graphed.enable_decode_graphs(scratch, -(-200 // page_size), sizes=GRAPH_SIZES)
    bufs = dict(zip("qkv", random_qkv(spec, max(GRAPH_SIZES), gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = [graphed.forward(i, x["q"], x["k"], x["v"], kv=graph_kv) for i in range(LAYERS)]
        res = torch.empty(outs[0].shape[0], LAYERS, *outs[0].shape[1:], dtype=outs[0].dtype)
        harness.launch(lambda: torch.stack(outs, dim=1, out=res))
        return res

    graphs = DecodeGraphs(graphed, forward, bufs, page_size)
    graphs.capture()
    for layer in range(LAYERS):  # capture wrote only the scratch page
        ref_kv.layers[layer][scratch].view(torch.uint8).copy_(
            graph_kv.layers[layer][scratch].view(torch.uint8)
        )
    ref = TorchAttention(fp8_spec(spec_for(heads, page_size, window, torch.float32, "cpu")))
    for decodes in ([40, 3, 17], [1, 2, 3, 4, 5, 6, 7, 150]):
        batch = like_the_runner(make_batch([], decodes, page_size, num_pages, gen))
        qkv = random_qkv(spec, len(decodes), gen)
        out = graphs.replay(batch, dict(zip("qkv", qkv, strict=True)))
        assert out is not None
        expected = eager_outputs(ref, batch, [t.float() for t in qkv], ref_kv)
        torch.testing.assert_close(out.float(), expected, **TOL)
        for g, r in zip(graph_kv.layers, ref_kv.layers, strict=True):
            assert same_bytes(g[:scratch], r[:scratch])


@pytest.mark.usefixtures("fi_cpu")
def test_flashinfer_refuses_a_cache_of_another_dtype_than_planned() -> None:
    spec = fp8_spec(spec_for((4, 4, 64), 16, None, torch.bfloat16, "cpu"))
    fi = FlashInferAttention(spec, workspace_bytes=2**20)
    gen = seed("fp8 refuse")
    batch = like_the_runner(make_batch([], [5], 16, 8, gen))
    bf16_kv = KvCache(
        num_layers=1, num_pages=8, page_size=16, num_kv_heads=4, head_dim=64,
        dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    fi.begin_step(batch)
    with pytest.raises(ValueError, match=r"planned for torch\.float8_e4m3fn"):
        fi.forward(0, *random_qkv(spec, 1, gen), kv=bf16_kv)
