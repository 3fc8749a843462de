"""FlashInfer attention: host-side index building (CPU) and, on a GPU, equality with
the torch reference (outputs within bf16 tolerance, identical cache contents) and
CUDA-graph replays equal to eager decode steps.

GPU tests skip without CUDA, and without flashinfer unless
RADIXSERVE_REQUIRE_FLASHINFER=1 (scripts/gpu_check.sh sets it: there a missing
flashinfer is a broken bundle, not a reason to skip)."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker_service.support.attention_batches import (
    BATCHES,
    HEADS,
    make_batch,
    pages_of,
    spec_for,
)
from worker_service.attention.base import AttentionSpec, SeqColumns, SequenceSlice
from worker_service.attention.flashinfer_backend import (
    DEFAULT_GRAPH_SIZES,
    FlashInferAttention,
    check_token_order,
    gather_bases,
    kv_rows,
    paged_layout,
    pick_graph_size,
    store_kv,
)
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.execution.cuda_graphs import DecodeGraphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- host side (CPU) ------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_layout_matches_definition(page_size: int) -> None:
    """Host CSR arrays from the columns, indices gathered from the page-table rows."""
    gen = torch.Generator().manual_seed(page_size)
    batch = make_batch([(5, 5), (3, 40)], [1, 16, 17, 33], page_size, 1024 // page_size, gen)
    lay = paged_layout(batch.columns, page_size, pad_to=9)
    q_lens = [s.q_len for s in batch.seqs] + [1] * 3
    assert lay.qo_indptr.tolist() == np.cumsum([0, *q_lens]).tolist()
    bases = gather_bases(batch.pages, batch.columns, lay.counts)
    total = int(lay.counts.sum())
    out = torch.full((total + 5,), -1, dtype=torch.int32)
    indices = batch.pages.gather(
        torch.from_numpy(bases), torch.from_numpy(lay.counts), total, out=out
    )
    assert indices.data_ptr() == out.data_ptr() and (out[total:] == -1).all()
    for i, s in enumerate(batch.seqs):
        pages = indices[lay.kv_indptr[i] : lay.kv_indptr[i + 1]].tolist()
        assert pages == pages_of(batch, s) and len(pages) == lay.counts[i]
        assert (len(pages) - 1) * page_size + lay.last_page_len[i] == s.kv_len
    assert np.diff(lay.kv_indptr[6:]).tolist() == [1] * 3
    assert lay.last_page_len[6:].tolist() == [1] * 3
    assert all(a.dtype == np.int32 for a in vars(lay).values())


def test_paged_layout_rejects_bad_sequences() -> None:
    batch = make_batch([], [20], 16, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="page-table row"):
        gather_bases(batch.pages, batch.columns, np.array([3], np.int32))
    with pytest.raises(ValueError, match="q_len"):
        paged_layout(SeqColumns.of([SequenceSlice(0, 5, 4, 0)]), 16)


def test_check_token_order() -> None:
    batch = make_batch([(4, 9)], [3, 5], 4, 16, torch.Generator().manual_seed(0))
    check_token_order(batch)
    batch.columns.q_starts[1] = 5
    with pytest.raises(ValueError, match="in order"):
        check_token_order(batch)


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_matches_kv_cache_write(page_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    batch = make_batch([(7, 20)], [3, 30], page_size, 64, gen)
    shape = {"num_layers": 1, "num_pages": 64, "page_size": page_size, "num_kv_heads": 2}
    a = KvCache(**shape, head_dim=8, dtype=torch.float32, device="cpu")
    b = KvCache(**shape, head_dim=8, dtype=torch.float32, device="cpu")
    k, v = torch.randn(2, batch.num_tokens, 2, 8, generator=gen)
    a.write(0, k, v, pages=batch.write_pages, offsets=batch.write_offsets)
    rows = kv_rows(batch.write_pages, batch.write_offsets, page_size)
    store_kv(b.layers[0], torch.stack([rows, rows + page_size]), k, v)
    assert torch.equal(a.layers[0], b.layers[0])


def test_pick_graph_size() -> None:
    assert pick_graph_size(3, (1, 2, 4, 8)) == 4
    assert pick_graph_size(8, (1, 2, 4, 8)) == 8
    assert pick_graph_size(9, (1, 2, 4, 8)) is None
    assert pick_graph_size(1, ()) is None


def test_default_graph_sizes_pad_a_batch_by_at_most_seven_rows() -> None:
    """SGLang's sizes: 1, 2, 4, then every 8 to 256. Padding is at most 3 rows
    below batch 8 and 7 above, under 10% of the rows replayed past batch 64."""
    assert DEFAULT_GRAPH_SIZES[:5] == (1, 2, 4, 8, 16) and len(DEFAULT_GRAPH_SIZES) == 35
    for n in range(1, 257):
        size = pick_graph_size(n, DEFAULT_GRAPH_SIZES)
        assert size is not None and 0 <= size - n <= (3 if n < 8 else 7), n
        if n > 64:
            assert (size - n) / size < 0.10, n
    assert pick_graph_size(257, DEFAULT_GRAPH_SIZES) is None


def test_construction_refuses_cpu_and_fp32() -> None:
    with pytest.raises(ValueError, match="fp16/bf16"):
        FlashInferAttention(spec_for((4, 2, 64), 16, None, torch.float32, "cpu"))
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        FlashInferAttention(spec_for((4, 2, 64), 16, None, torch.bfloat16, "cpu"))


def test_module_does_not_import_flashinfer() -> None:
    code = (
        "import sys, worker_service.attention.flashinfer_backend\n"
        "import worker_service.execution.cuda_graphs\n"
        "assert 'flashinfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ---- GPU: FlashInfer vs the torch reference ---------------------------------------------


def random_caches(spec: AttentionSpec, num_pages: int, gen: torch.Generator):
    """A bf16 cache with random contents and an exact fp32 copy for the reference."""
    shape = {
        "num_layers": 2,
        "num_pages": num_pages,
        "page_size": spec.page_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "device": "cuda",
    }
    fi, ref = KvCache(**shape, dtype=spec.dtype), KvCache(**shape, dtype=torch.float32)
    for a, b in zip(fi.layers, ref.layers, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen).to(a.dtype))
        b.copy_(a.float())
    return fi, ref


def random_qkv(spec: AttentionSpec, tokens: int, gen: torch.Generator):
    shapes = [(tokens, spec.num_heads, spec.head_dim)] + [
        (tokens, spec.num_kv_heads, spec.head_dim)
    ] * 2
    return [torch.randn(s, generator=gen).to("cuda", spec.dtype) for s in shapes]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("tensor_cores", [None, False, True])
def test_flashinfer_matches_torch(page_size, heads, window, kind, tensor_cores) -> None:
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cuda")
    ref_spec = spec_for(heads, page_size, window, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(zlib.crc32(repr((page_size, heads, window, kind)).encode()))
    num_pages = 4096 // page_size
    # write positions on the host (the backend takes them there too), pages on the GPU
    batch = make_batch(*BATCHES[kind], page_size, num_pages, gen, table_device="cuda")
    fi_kv, ref_kv = random_caches(spec, num_pages, gen)
    fi = FlashInferAttention(spec, workspace_bytes=64 * 2**20, decode_tensor_cores=tensor_cores)
    ref = TorchAttention(ref_spec)
    fi.begin_step(batch)
    ref.begin_step(batch)
    for layer in range(2):
        q, k, v = random_qkv(spec, batch.num_tokens, gen)
        out = fi.forward(layer, q, k, v, kv=fi_kv)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), kv=ref_kv)
        assert torch.equal(fi_kv.layers[layer].float(), ref_kv.layers[layer])
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS[:2])
@pytest.mark.parametrize("window", [None, 24])
def test_graph_decode_equals_eager(page_size, heads, window) -> None:
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(7)
    num_pages = 2048 // page_size
    scratch = num_pages - 1
    graph_kv, _ = random_caches(spec, num_pages, gen)
    eager_kv, _ = random_caches(spec, num_pages, gen)
    for a, b in zip(graph_kv.layers, eager_kv.layers, strict=True):
        b.copy_(a)
    graphed = FlashInferAttention(spec, workspace_bytes=64 * 2**20)
    graphed.enable_decode_graphs(scratch, -(-200 // page_size), sizes=(1, 2, 4, 8))
    eager = FlashInferAttention(spec, workspace_bytes=64 * 2**20)
    bufs = dict(zip("qkv", random_qkv(spec, 8, gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = [graphed.forward(i, x["q"], x["k"], x["v"], kv=graph_kv) for i in range(2)]
        return torch.stack(outs, dim=1)

    graphs = DecodeGraphs(graphed, forward, bufs, page_size)
    graphs.capture()
    assert set(graphs.graphs) == {1, 2, 4, 8}
    for decodes in ([40, 3, 17], [1, 2, 3, 4, 5, 6, 7, 150], [64]):
        batch = make_batch([], decodes, page_size, num_pages, gen, "cuda")
        q, k, v = random_qkv(spec, len(decodes), gen)
        out = graphs.replay(batch, {"q": q, "k": k, "v": v})
        assert out is not None
        eager.begin_step(batch)
        expected = torch.stack([eager.forward(i, q, k, v, kv=eager_kv) for i in range(2)], 1)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        for a, b in zip(graph_kv.layers, eager_kv.layers, strict=True):
            assert torch.equal(a[:scratch], b[:scratch])
    too_many = make_batch([], [1] * 9, page_size, num_pages, gen, table_device="cuda")
    assert graphs.replay(too_many, {}) is None
