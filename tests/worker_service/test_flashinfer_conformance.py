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

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import BATCHES, HEADS, make_batch, spec_for
from tests.worker_service.support.flashinfer_conformance import (
    GRAPH_SIZES,
    LAYERS,
    TOL,
    backends,
    compare_step,
    eager_outputs,
    graph_setup,
    like_the_runner,
    random_caches,
    random_qkv,
    seed,
)
from worker_service.attention.base import (
    AttentionBatch,
    SequenceSlice,
)
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable
from worker_service.execution.cuda_graphs import DecodeGraphs, pad_verify_batch

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer-python is not installed (make setup installs it without CUDA deps)",
)

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
    row: int  # its page-table row
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions already in the cache


class Workload:
    """Builds each step's batch the way the scheduler does: extends first, then
    decodes; a request reads its pages from position 0, shared prefix pages included."""

    def __init__(self, page_size: int, num_pages: int, gen: torch.Generator) -> None:
        self.page_size = page_size
        # The last page stays free (a CUDA-graph scratch page in the runner).
        self.free = torch.randperm(num_pages - 1, generator=gen).tolist()
        # Rows as the runner keeps them: appended to as requests grow.
        self.table = PageTable("cpu", rows=1, columns=1)

    def join(self, prefix_of: Request | None = None, shared: int = 0) -> Request:
        """A new request; ``shared`` positions of ``prefix_of`` (whole pages) are a
        cache hit: it reads those pages and never writes them."""
        r = Request(self.table.acquire())
        if prefix_of is None:
            return r
        assert shared % self.page_size == 0 and shared <= prefix_of.kv_len
        r.pages, r.kv_len = prefix_of.pages[: shared // self.page_size], shared
        self.table.append(r.row, r.pages)
        return r

    def _grow(self, r: Request, kv_len: int) -> None:
        while len(r.pages) * self.page_size < kv_len:
            r.pages.append(self.free.pop())
            self.table.append(r.row, r.pages[-1:])

    def step(self, extends: list[tuple[Request, int]], decodes: list[Request]) -> AttentionBatch:
        seqs, positions, pages = [], [], []
        for r, q_len in [*extends, *((r, 1) for r in decodes)]:
            start = r.kv_len
            self._grow(r, start + q_len)
            r.kv_len += q_len
            seqs.append(SequenceSlice(len(positions), q_len, r.kv_len, r.row))
            for p in range(start, r.kv_len):
                positions.append(p)
                pages.append(r.pages[p // self.page_size])
        pos = torch.tensor(positions)
        return AttentionBatch(
            seqs,
            len(extends),
            pos,
            torch.tensor(pages),
            pos % self.page_size,
            self.page_size,
            pages=self.table,
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

GRAPH_DECODES = ([40, 3, 17], [1, 2, 3, 4, 5, 6, 7, 150], [64])  # as the GPU test


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


@pytest.mark.usefixtures("fi_cpu")
def test_a_larger_replay_leaves_a_smaller_replays_output(monkeypatch) -> None:
    """Both sizes capture into one pool. The forward frees an intermediate as
    the last layers of a model do; the caching allocator hands that block to
    the smaller graph's capture, whose output lands in it. Replaying the
    larger graph rewrites the block: an output kept in the pool would change
    under a reader that has not read it yet."""
    heads, page_size = HEADS[0], 16
    spec = spec_for(heads, page_size, None, torch.bfloat16, "cpu")
    gen = seed("pool", heads)
    num_pages = 512 // page_size
    harness.install_graph_stand_ins(monkeypatch)
    kv, _ = random_caches(spec, num_pages, gen)
    graphed = FlashInferAttention(spec, workspace_bytes=2**20)
    graphed.enable_decode_graphs(num_pages - 1, -(-200 // page_size), sizes=(4, 8))
    bufs = dict(zip("qkv", random_qkv(spec, 8, gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        attn = graphed.forward(0, x["q"], x["k"], x["v"], kv=kv)
        mid = harness.pool_empty(tuple(attn.shape), attn.dtype)
        harness.launch(lambda: torch.mul(attn, 2, out=mid))
        out = harness.pool_empty(tuple(attn.shape), attn.dtype)
        harness.launch(lambda: torch.add(mid, 1, out=out))
        harness.pool_free(mid)
        return out

    graphs = DecodeGraphs(graphed, forward, bufs, page_size)
    graphs.capture()
    small = like_the_runner(make_batch([], [40, 3, 17], page_size, num_pages, gen))
    out_small = graphs.replay(small, dict(zip("qkv", random_qkv(spec, 3, gen), strict=True)))
    assert out_small is not None
    read_later = out_small.clone()
    large = like_the_runner(make_batch([], [5, 9, 1, 30, 2, 8, 70], page_size, num_pages, gen))
    assert graphs.replay(large, dict(zip("qkv", random_qkv(spec, 7, gen), strict=True))) is not None
    assert torch.equal(out_small, read_later), "the larger replay overwrote the smaller output"


# ---- CUDA graphs for drafted steps (verify) --------------------------------------------

VERIFY_ROWS = 4  # rows per sequence: up to 3 drafts
# (q_len, kv_len) of drafted extends, then decodes' kv_len: a row that drafted fewer
# than 3 is padded, past its last page too (kv 16 - 2 + 4 and 16 - 1 + 4 at page 16).
VERIFY_STEPS = (
    ([(4, 20), (2, 16), (3, 3)], [16, 40]),
    ([(2, 33)], []),
    ([(4, 4), (4, 100), (2, 17), (3, 31)], []),
)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 24])
def test_verify_graphs_conform(monkeypatch, page_size, heads, window) -> None:
    """Drafted steps padded to VERIFY_ROWS rows a sequence (pad_verify_batch) and
    replayed through the verify graphs equal eager FlashInfer and TorchAttention on
    the unpadded step, real rows only; the padding wrote only the scratch page."""
    spec = spec_for(heads, page_size, window, torch.bfloat16, "cpu")
    gen = seed("verify", page_size, heads, window)
    num_pages = 512 // page_size
    scratch = num_pages - 1
    harness.install_graph_stand_ins(monkeypatch)
    graph_kv, _ = random_caches(spec, num_pages, gen)
    eager_kv, ref_kv = random_caches(spec, num_pages, gen)
    for g, e, r in zip(graph_kv.layers, eager_kv.layers, ref_kv.layers, strict=True):
        e.copy_(g)
        r.copy_(g.float())
    graphed = FlashInferAttention(spec, workspace_bytes=2**20)
    graphed.enable_decode_graphs(scratch, -(-200 // page_size), sizes=(1,))
    graphed.enable_verify_graphs(VERIFY_ROWS, sizes=(2, 4, 8))
    verify = graphed.verify_graphs
    bufs = dict(zip("qkv", random_qkv(spec, 8 * VERIFY_ROWS, gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = [graphed.forward(i, x["q"], x["k"], x["v"], kv=graph_kv) for i in range(LAYERS)]
        res = torch.empty(outs[0].shape[0], LAYERS, *outs[0].shape[1:], dtype=outs[0].dtype)
        harness.launch(lambda: torch.stack(outs, dim=1, out=res))
        return res

    graphs = DecodeGraphs(verify, forward, bufs, page_size, rows_per_seq=VERIFY_ROWS)
    graphs.capture()
    assert set(graphs.graphs) == {2, 4, 8}
    eager, ref = backends(heads, page_size, window)
    for extends, decodes in VERIFY_STEPS:
        batch = like_the_runner(make_batch(extends, decodes, page_size, num_pages, gen))
        qkv = random_qkv(spec, batch.num_tokens, gen)
        ids = torch.arange(batch.num_tokens)
        padded, padded_ids, dest = pad_verify_batch(
            batch, ids, rows_per_seq=VERIFY_ROWS, scratch_page=scratch
        )
        assert torch.equal(padded_ids[torch.from_numpy(dest)], ids)
        assert torch.equal(padded.positions[torch.from_numpy(dest)], batch.positions)
        padded_qkv = {}
        for name, t in zip("qkv", qkv, strict=True):
            padded_qkv[name] = torch.zeros(padded.num_tokens, *t.shape[1:], dtype=t.dtype)
            padded_qkv[name][torch.from_numpy(dest)] = t
        launched = sum(reference.CALLS.values())
        out = graphs.replay(padded, padded_qkv)
        assert out is not None and out.shape[0] == len(batch.seqs) * VERIFY_ROWS
        # The replay re-ran the captured launches; it launched nothing itself (only planned).
        assert sum(reference.CALLS.values()) == launched + 1
        real = out[torch.from_numpy(dest)]
        expected = eager_outputs(eager, batch, qkv, eager_kv)
        torch.testing.assert_close(real, expected, atol=1e-2, rtol=1e-2)
        reference_out = eager_outputs(ref, batch, [t.float() for t in qkv], ref_kv)
        torch.testing.assert_close(real.float(), reference_out, **TOL)
        for g, e in zip(graph_kv.layers, eager_kv.layers, strict=True):
            assert torch.equal(g[:scratch], e[:scratch])
    # A row of more than VERIFY_ROWS rows, or a prompt chunk, does not fit.
    too_long = make_batch([(5, 30)], [], page_size, num_pages, gen)
    with pytest.raises(ValueError, match="does not fit"):
        pad_verify_batch(too_long, torch.arange(5), rows_per_seq=VERIFY_ROWS, scratch_page=scratch)
    nine = make_batch([(2, 20)] * 9, [], page_size, num_pages, gen)
    padded, _, _ = pad_verify_batch(
        nine, torch.arange(18), rows_per_seq=VERIFY_ROWS, scratch_page=scratch
    )
    assert verify.graph_size_for(padded) is None
    assert graphs.replay(padded, {}) is None
