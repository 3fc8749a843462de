"""The FlashInfer conformance comparison (test_flashinfer_conformance.py) and
its mutation tests (test_flashinfer_mutations.py) share: seeded random caches
and q/k/v, the runner's placement of write positions, one step on our
FlashInfer backend against TorchAttention (caches bit-identical, outputs
within the GPU tests' bf16 tolerance), and CUDA-graph decode captured through
the real DecodeGraphs. The ``fi_cpu`` fixture (tests/worker_service/conftest.py)
installs the CPU harness they run under."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import spec_for
from worker_service.attention.base import AttentionBackend, AttentionBatch, AttentionSpec
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.execution.cuda_graphs import DecodeGraphs

TOL = {"atol": 2e-2, "rtol": 2e-2}  # test_flashinfer_backend.py's bf16 tolerance
LAYERS = 2
GRAPH_SIZES = (1, 2, 4, 8)


def seed(*key: Any) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_caches(
    spec: AttentionSpec, num_pages: int, gen: torch.Generator
) -> tuple[KvCache, KvCache]:
    """A bf16 cache with random contents and an exact fp32 copy for TorchAttention."""
    shape = {
        "num_layers": LAYERS,
        "num_pages": num_pages,
        "page_size": spec.page_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "device": "cpu",
    }
    fi, ref = KvCache(**shape, dtype=spec.dtype), KvCache(**shape, dtype=torch.float32)
    for a, b in zip(fi.layers, ref.layers, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen).to(a.dtype))
        b.copy_(a.float())
    return fi, ref


def random_qkv(spec: AttentionSpec, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    heads = [spec.num_heads, spec.num_kv_heads, spec.num_kv_heads]
    return [torch.randn(tokens, h, spec.head_dim, generator=gen).to(spec.dtype) for h in heads]


def like_the_runner(batch: AttentionBatch) -> AttentionBatch:
    """The model runner hands the backend its write positions on the device."""
    for name in ("positions", "write_pages", "write_offsets"):
        setattr(batch, name, reference.PLACEMENT.mark_device(getattr(batch, name).clone()))
    return batch


def compare_step(
    fi: FlashInferAttention,
    ref: TorchAttention,
    batch: AttentionBatch,
    fi_kv: KvCache,
    ref_kv: KvCache,
    gen: torch.Generator,
    layers: int = LAYERS,
) -> None:
    """One step on both backends: identical caches, outputs within tolerance."""
    fi.begin_step(batch)
    ref.begin_step(batch)
    for layer in range(layers):
        q, k, v = random_qkv(fi.spec, batch.num_tokens, gen)
        out = fi.forward(layer, q, k, v, kv=fi_kv)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), kv=ref_kv)
        assert torch.equal(fi_kv.layers[layer].float(), ref_kv.layers[layer]), "KV cache differs"
        torch.testing.assert_close(out.float(), expected, **TOL)


def backends(
    heads: tuple[int, int, int],
    page_size: int,
    window: int | None,
    tensor_cores: bool | None = None,
    *,
    soft_cap: float | None = None,
) -> tuple[FlashInferAttention, TorchAttention]:
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cpu")
    ref_spec = spec_for(heads, page_size, window, torch.float32, "cpu")
    spec = dataclasses.replace(spec, logit_soft_cap=soft_cap)
    ref_spec = dataclasses.replace(ref_spec, logit_soft_cap=soft_cap)
    fi = FlashInferAttention(spec, workspace_bytes=2**20, decode_tensor_cores=tensor_cores)
    return fi, TorchAttention(ref_spec)


def graph_setup(
    monkeypatch: pytest.MonkeyPatch,
    spec: AttentionSpec,
    num_pages: int,
    gen: torch.Generator,
    sizes: tuple[int, ...] = GRAPH_SIZES,
    layers: int = LAYERS,
) -> tuple[DecodeGraphs, KvCache]:
    """Our backend with decode graphs of ``sizes``, captured by DecodeGraphs over a
    model forward of ``layers`` attention layers (outputs stacked on dim 1)."""
    harness.install_graph_stand_ins(monkeypatch)
    kv, _ = random_caches(spec, num_pages, gen)
    graphed = FlashInferAttention(spec, workspace_bytes=2**20)
    graphed.enable_decode_graphs(num_pages - 1, -(-200 // spec.page_size), sizes=sizes)
    bufs = dict(zip("qkv", random_qkv(spec, max(sizes), gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = [graphed.forward(i, x["q"], x["k"], x["v"], kv=kv) for i in range(layers)]
        res = torch.empty(outs[0].shape[0], layers, *outs[0].shape[1:], dtype=outs[0].dtype)
        # The model's own op, captured like the attention kernels.
        harness.launch(lambda: torch.stack(outs, dim=1, out=res))
        return res

    graphs = DecodeGraphs(graphed, forward, bufs, spec.page_size)
    graphs.capture()
    return graphs, kv


def eager_outputs(
    attn: AttentionBackend, batch: AttentionBatch, qkv: list[torch.Tensor], kv: KvCache
) -> torch.Tensor:
    attn.begin_step(batch)
    layers = len(kv.layers)
    return torch.stack([attn.forward(i, *qkv, kv=kv) for i in range(layers)], dim=1)
