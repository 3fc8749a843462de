"""FlashInfer conformance on the CPU: our ``FlashInferAttention`` drives FlashInfer's
real wrappers (flashinfer-python 0.7.2.post1) whose compiled kernels are swapped for
torch references of their documented semantics (flashinfer_reference.py, installed by
flashinfer_cpu_harness.py), and must agree with ``TorchAttention``: outputs within the
GPU tests' bf16 tolerance, KV caches bit-identical.

Covered: the GPU tests' grid (page size 1/16, GQA groups 1/4/6, sliding window,
extend-only / decode-only / mixed batches, CUDA-core and tensor-core decode), several
steps of a served workload (chunked prefill, a prefix served from another request's
pages, mixed extend + decode steps), and CUDA-graph decode through the real
``DecodeGraphs`` (capture of every size on an all-padding batch, replays padded to a
captured size, the scratch page). The mutation tests (test_flashinfer_mutations.py)
break one thing our backend hands FlashInfer at a time and require this comparison
to fail.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import BATCHES, HEADS, make_batch, spec_for
from worker_service.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
    SequenceSlice,
)
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.execution.cuda_graphs import DecodeGraphs

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer-python is not installed (make setup installs it without CUDA deps)",
)

TOL = {"atol": 2e-2, "rtol": 2e-2}  # test_flashinfer_backend.py's bf16 tolerance
LAYERS = 2


@pytest.fixture
def fi_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[reference.Placement]:
    # Every tensor here is tiny: intra-op threads cost more than they save, and on
    # a busy 2-core machine their spin-waits made each op ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield harness.install(monkeypatch)
    finally:
        harness.clear_module_caches()
        torch.set_num_threads(threads)


# ---- helpers --------------------------------------------------------------------------


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
) -> tuple[FlashInferAttention, TorchAttention]:
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cpu")
    ref_spec = spec_for(heads, page_size, window, torch.float32, "cpu")
    fi = FlashInferAttention(spec, workspace_bytes=2**20, decode_tensor_cores=tensor_cores)
    return fi, TorchAttention(ref_spec)


# ---- the GPU tests' grid ----------------------------------------------------------------


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("tensor_cores", [None, False, True])
def test_conforms_on_the_gpu_grid(page_size, heads, window, kind, tensor_cores) -> None:
    gen = seed(page_size, heads, window, kind)
    num_pages = 512 // page_size
    batch = like_the_runner(make_batch(*BATCHES[kind], page_size, num_pages, gen))
    fi, ref = backends(heads, page_size, window, tensor_cores)
    fi_kv, ref_kv = random_caches(fi.spec, num_pages, gen)
    compare_step(fi, ref, batch, fi_kv, ref_kv, gen)
    # The kernels that ran are the ones our backend means to use.
    group = heads[0] // heads[1]
    tensor_core_decode = group >= 4 if tensor_cores is None else tensor_cores
    extends, decodes = BATCHES[kind]
    prefill_runs = LAYERS * (bool(extends) + (bool(decodes) and tensor_core_decode))
    assert reference.CALLS["prefill.paged_run"] == prefill_runs
    assert reference.CALLS["decode.run"] == LAYERS * (bool(decodes) and not tensor_core_decode)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("tensor_cores", [None, False])
def test_conforms_in_fp16(tensor_cores) -> None:
    gen = seed("fp16", tensor_cores)
    batch = like_the_runner(make_batch(*BATCHES["mixed"], 16, 32, gen))
    spec = spec_for(HEADS[0], 16, 24, torch.float16, "cpu")
    fi = FlashInferAttention(spec, workspace_bytes=2**20, decode_tensor_cores=tensor_cores)
    ref = TorchAttention(spec_for(HEADS[0], 16, 24, torch.float32, "cpu"))
    fi_kv, ref_kv = random_caches(spec, 32, gen)
    compare_step(fi, ref, batch, fi_kv, ref_kv, gen)


# ---- a served workload: chunked prefill, prefix hits, mixed steps ---------------------


@dataclass
class Request:
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions already in the cache


class Workload:
    """Builds each step's batch the way the scheduler does: extends first, then
    decodes; a request reads its pages from position 0, shared prefix pages included."""

    def __init__(self, page_size: int, num_pages: int, gen: torch.Generator) -> None:
        self.page_size = page_size
        # The last page stays free (a CUDA-graph scratch page in the runner).
        self.free = torch.randperm(num_pages - 1, generator=gen).tolist()

    def join(self, prefix_of: Request | None = None, shared: int = 0) -> Request:
        """A new request; ``shared`` positions of ``prefix_of`` (whole pages) are a
        cache hit: it reads those pages and never writes them."""
        if prefix_of is None:
            return Request()
        assert shared % self.page_size == 0 and shared <= prefix_of.kv_len
        return Request(prefix_of.pages[: shared // self.page_size], shared)

    def _grow(self, r: Request, kv_len: int) -> None:
        while len(r.pages) * self.page_size < kv_len:
            r.pages.append(self.free.pop())

    def step(self, extends: list[tuple[Request, int]], decodes: list[Request]) -> AttentionBatch:
        seqs, positions, pages = [], [], []
        for r, q_len in [*extends, *((r, 1) for r in decodes)]:
            start = r.kv_len
            self._grow(r, start + q_len)
            r.kv_len += q_len
            seqs.append(SequenceSlice(len(positions), q_len, r.kv_len, list(r.pages)))
            for p in range(start, r.kv_len):
                positions.append(p)
                pages.append(r.pages[p // self.page_size])
        pos = torch.tensor(positions)
        return AttentionBatch(
            seqs, len(extends), pos, torch.tensor(pages), pos % self.page_size, self.page_size
        )


def served_steps(w: Workload) -> Iterator[AttentionBatch]:
    a, b = w.join(), w.join()
    yield w.step([(a, 16), (b, 23)], [])  # a's 40-token prompt in chunks of 16
    yield w.step([(a, 16)], [b])
    c = w.join(prefix_of=a, shared=32)  # c's first 32 tokens are a's
    yield w.step([(a, 8), (c, 13)], [b])
    for _ in range(3):
        yield w.step([], [a, b, c])
    d = w.join(prefix_of=b, shared=16)  # a prefix hit on b's pages
    yield w.step([(d, 9)], [a, b, c])
    for _ in range(2):
        yield w.step([], [d, c, b, a])


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("writes_on_device", [True, False])
def test_conforms_over_a_served_workload(page_size, heads, window, writes_on_device) -> None:
    """Several steps on one cache: plans replace each other, chunks and prefix
    hits read pages written by earlier steps (and other requests). The runner
    gives write positions on the device; the backend also takes them on the host."""
    gen = seed("served", page_size, heads, window)
    num_pages = 512 // page_size
    fi, ref = backends(heads, page_size, window)
    fi_kv, ref_kv = random_caches(fi.spec, num_pages, gen)
    for batch in served_steps(Workload(page_size, num_pages, gen)):
        batch = like_the_runner(batch) if writes_on_device else batch
        compare_step(fi, ref, batch, fi_kv, ref_kv, gen)


# ---- CUDA-graph decode through the real DecodeGraphs ----------------------------------

GRAPH_SIZES = (1, 2, 4, 8)
GRAPH_DECODES = ([40, 3, 17], [1, 2, 3, 4, 5, 6, 7, 150], [64])  # as the GPU test


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


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
def test_graph_decode_conforms(monkeypatch, page_size, heads, window) -> None:
    """Replays (padded to a captured size, padding on the scratch page) equal eager
    FlashInfer steps and TorchAttention; the cache outside the scratch page too."""
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cpu")
    gen = seed("graphs", page_size, heads, window)
    num_pages = 512 // page_size
    scratch = num_pages - 1
    graphs, graph_kv = graph_setup(monkeypatch, spec, num_pages, gen)
    assert set(graphs.graphs) == set(GRAPH_SIZES)
    shape = {
        "num_layers": LAYERS,
        "num_pages": num_pages,
        "page_size": page_size,
        "num_kv_heads": heads[1],
        "head_dim": heads[2],
        "device": "cpu",
    }
    eager_kv = KvCache(**shape, dtype=spec.dtype)
    ref_kv = KvCache(**shape, dtype=torch.float32)
    for g, e, r in zip(graph_kv.layers, eager_kv.layers, ref_kv.layers, strict=True):
        e.copy_(g)
        r.copy_(g.float())
    eager, ref = backends(heads, page_size, window)
    for decodes in GRAPH_DECODES:
        batch = like_the_runner(make_batch([], decodes, page_size, num_pages, gen))
        qkv = random_qkv(spec, len(decodes), gen)
        launched = sum(reference.CALLS.values())
        out = graphs.replay(batch, dict(zip("qkv", qkv, strict=True)))
        assert out is not None
        # The replay re-ran the captured launches; it launched nothing itself (only planned).
        planned = 1
        assert sum(reference.CALLS.values()) == launched + planned
        expected = eager_outputs(eager, batch, qkv, eager_kv)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        reference_out = eager_outputs(ref, batch, [t.float() for t in qkv], ref_kv)
        torch.testing.assert_close(out.float(), reference_out, **TOL)
        for g, e, r in zip(graph_kv.layers, eager_kv.layers, ref_kv.layers, strict=True):
            assert torch.equal(g[:scratch], e[:scratch])
            assert torch.equal(g[:scratch].float(), r[:scratch])
    too_many = make_batch([], [1] * 9, page_size, num_pages, gen)
    assert graphs.replay(too_many, {}) is None
