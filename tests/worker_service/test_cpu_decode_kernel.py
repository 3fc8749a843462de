"""The CPU decode-attention kernel (worker_service/attention/cpu_kernels/
paged_decode.c) against the torch path it replaces (gather + SDPA), over page
sizes, head groups, head dims, windows, dtypes (an fp8 e4m3 cache with its
scales too), thread splits and steps that mix extends with decodes; and the
fallbacks when it cannot be built or does not fit the model."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.attention_batches import make_batch
from worker_service.attention import cpu_paged_kernel
from worker_service.attention.base import AttentionSpec
from worker_service.attention.cpu_paged_kernel import PagedDecodeKernel, load_paged_decode
from worker_service.attention.torch_backend import KERNEL_MAX_QUERIES, TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import FP8_E4M3, KvScales, quantize_fp8
from worker_service.kernels import c_build

CPU = torch.device("cpu")
NUM_PAGES = 320


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    k = load_paged_decode(9, 3, 64, 1)  # the default model's shape
    assert k is not None, "the kernel must build on the CI machine (gcc is there)"
    return k


def attend(
    spec: AttentionSpec, kernel: PagedDecodeKernel | None, batch, q, k, v, kv
) -> torch.Tensor:
    attn = TorchAttention(spec, kernel)
    assert (attn.decode_kernel is not None) == (kernel is not None)
    attn.begin_step(batch)
    return attn.forward(0, q, k, v, kv=kv)


def case(page_size, heads, kv_heads, head_dim, window, dtype, extends, decodes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(heads, kv_heads, head_dim, page_size, window, dtype, CPU)
    kv = KvCache(
        num_layers=1,
        num_pages=NUM_PAGES,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=CPU,
    )
    kv.layers[0].copy_(torch.randn(kv.layers[0].shape, generator=gen))
    batch = make_batch(extends, decodes, page_size, NUM_PAGES, gen)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    return spec, batch, q, k, v, kv


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    ("page_size", "heads", "kv_heads", "head_dim"),
    [(16, 9, 3, 64), (1, 4, 4, 64), (4, 8, 2, 128), (16, 6, 1, 32), (3, 10, 2, 16)],
)
def test_kernel_matches_torch(kernel, page_size, heads, kv_heads, head_dim, window, dtype) -> None:
    # Lengths at and around page boundaries, a one-token context and a long
    # row; extends with a prefix and a whole prompt in the same step. Extends
    # of up to KERNEL_MAX_QUERIES tokens (a drafted verify row: 9 here) attend
    # through the kernel, a row per query; (17, 25) through SDPA.
    decodes = [1, page_size, page_size + 1, 37, 150, 2]
    extends = [(5, 20), (9, 9), (KERNEL_MAX_QUERIES, 30), (KERNEL_MAX_QUERIES + 1, 25)]
    spec, batch, q, k, v, kv = case(
        page_size, heads, kv_heads, head_dim, window, dtype, extends, decodes
    )
    want = attend(spec, None, batch, q, k, v, kv)
    got = attend(spec, kernel, batch, q, k, v, kv)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert torch.isfinite(got).all()


def test_kernel_splits_across_threads(kernel) -> None:
    spec, batch, q, k, v, kv = case(16, 9, 3, 64, None, torch.float32, [], [40, 90, 3, 17, 64, 5])
    want = attend(spec, kernel, batch, q, k, v, kv)
    threaded = PagedDecodeKernel(kernel.library, threads=3)
    got = attend(spec, threaded, batch, q, k, v, kv)
    assert torch.equal(got, want)  # the same arithmetic per task, whichever thread runs it


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (12, 6)])
def test_kv_heads_read_together_give_each_task_s_result(heads, kv_heads) -> None:
    """A task range's consecutive kv heads of one sequence run side by side
    (paged_decode.c decode_heads, at most MAX_HEADS = 4 at a time); ranges
    that cut a sequence's heads anywhere, or take them two at a time, give
    the same bits as one call over every task."""
    base = load_paged_decode(heads, kv_heads, 64, 1)
    assert base is not None
    decodes = [40, 90, 3, 17]
    spec, batch, q, k, v, kv = case(16, heads, kv_heads, 64, None, torch.float32, [], decodes)
    want = attend(spec, base, batch, q, k, v, kv)
    tasks = len(decodes) * kv_heads
    for threads in (3, 5, tasks // 2):  # bounds from linspace: uneven cuts, then pairs
        split = PagedDecodeKernel(base.library, threads=threads)
        assert torch.equal(attend(spec, split, batch, q, k, v, kv), want), threads
    # and against torch's attention, to the usual tolerance
    torch.testing.assert_close(want, attend(spec, None, batch, q, k, v, kv), **tol(torch.float32))


class PiecesKernel(PagedDecodeKernel):
    """Each row as the decode chain's team runs it at one row:
    paged_decode_piece's four phases in turn, each cut into `parts` pieces."""

    def __init__(self, library, parts: int) -> None:
        super().__init__(library, 1)
        self.parts = parts

    def __call__(self, q, cache, out, *, layout, window, scale, soft_cap=None, sinks=None,
                 kv_scales=(1.0, 1.0)) -> None:  # fmt: skip
        _, heads, head_dim = q.shape
        page_size, kv_heads = cache.shape[2], cache.shape[3]
        for seq in range(layout.num_rows):
            scratch = torch.full(
                (self.piece_floats(heads, head_dim, int(layout.lens[seq])),), float("nan")
            )
            for phase in range(4):
                for part in range(self.parts):
                    status = self.piece(
                        q.data_ptr(), cpu_paged_kernel.DTYPE_CODES[q.dtype], cache.data_ptr(),
                        cpu_paged_kernel.CACHE_DTYPE_CODES[cache.dtype], out.data_ptr(),
                        layout.rows_p, layout.lens_p, layout.indptr_p, layout.pages_p,
                        page_size, heads, kv_heads, head_dim, window or 0,
                        scale * kv_scales[0], soft_cap or 0.0, kv_scales[1],
                        None if sinks is None else sinks.data_ptr(),
                        seq, phase, part, self.parts, scratch.data_ptr(),
                    )  # fmt: skip
                    assert status == 0


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    ("page_size", "heads", "kv_heads", "head_dim"),
    [(16, 9, 3, 64), (4, 8, 2, 128), (16, 6, 1, 32), (3, 10, 2, 16), (16, 12, 6, 64)],
)
def test_pieces_over_a_team_are_the_whole_row_s_bits(
    page_size, heads, kv_heads, head_dim, window, dtype, parts
) -> None:
    """The decode chain's team shares one row's attention (paged_decode_piece:
    scores by keys, the softmax by heads, the values by the row's two key
    halves, the outputs by heads): the same bits as the row run whole, odd
    and even spans, one-key rows, windows, more kv heads than are read
    together."""
    base = load_paged_decode(heads, kv_heads, head_dim, 1)
    assert base is not None
    decodes = [1, 2, page_size, page_size + 1, 37, 150]
    spec, batch, q, k, v, kv = case(
        page_size, heads, kv_heads, head_dim, window, dtype, [], decodes
    )
    want = attend(spec, base, batch, q, k, v, kv)
    got = attend(spec, PiecesKernel(base.library, parts), batch, q, k, v, kv)
    assert torch.equal(got, want)


@pytest.mark.skipif(not c_build.torch_uses_openmp(), reason="torch without OpenMP")
def test_openmp_build_runs_in_torchs_runtime(kernel) -> None:
    """With several threads the kernel is the OpenMP build, sharing torch's
    libgomp (no second runtime), and splits rows of uneven length by cost to
    the same result as one thread."""
    threaded = load_paged_decode(9, 3, 64, 2)
    assert threaded is not None and threaded.openmp and threaded.threads == 2
    assert threaded._pool is None
    assert len(c_build.loaded_libgomp()) == 1
    assert not kernel.openmp  # one thread: the plain build
    # Long enough (about 8.8k keys x kv heads) to pass paged_decode.c's
    # PARALLEL_MIN_COST, below which the calling thread runs every task.
    decodes = [1300, 3, 17, 800, 240, 5, 1, 300]
    spec, batch, q, k, v, kv = case(16, 9, 3, 64, None, torch.float32, [(9, 40)], decodes)
    want = attend(spec, kernel, batch, q, k, v, kv)
    for threads in (2, 3, 64):  # more threads than tasks too
        got = attend(spec, PagedDecodeKernel(threaded.library, threads), batch, q, k, v, kv)
        assert torch.equal(got, want)


def test_kernel_reads_strided_queries(kernel) -> None:
    """q, k, v arrive as views of one fused projection, as in the model."""
    spec, batch, q, k, v, kv = case(16, 9, 3, 64, None, torch.float32, [(4, 30)], [12, 33])
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv = fused[:, : 9 * 64].view(-1, 9, 64)
    assert not qv.is_contiguous()
    want = attend(spec, None, batch, q, k, v, kv)
    torch.testing.assert_close(
        attend(spec, kernel, batch, qv, k, v, kv), want, **tol(torch.float32)
    )


def test_unsupported_shapes_stay_on_torch(kernel) -> None:
    # head_dim 40 is not a multiple of 16: the backend keeps the torch path.
    spec = AttentionSpec(4, 2, 40, 16, None, torch.float32, CPU)
    assert TorchAttention(spec, kernel).decode_kernel is None
    spec16 = AttentionSpec(4, 2, 64, 16, None, torch.float16, CPU)
    assert TorchAttention(spec16, kernel).decode_kernel is None


def test_short_extends_are_kernel_rows(kernel) -> None:
    """Each query of a short extend becomes a kernel row over its own causal
    prefix; a longer extend stays on SDPA."""
    spec, batch, *_ = case(16, 9, 3, 64, None, torch.float32, [(9, 300), (17, 40)], [50])
    attn = TorchAttention(spec, kernel)
    attn.begin_step(batch)
    layout = attn._layout
    assert layout is not None and layout.num_rows == 9 + 1
    assert sorted(layout.lens.tolist()) == [50, *range(292, 301)]
    assert sorted(layout.rows.tolist()) == [*range(9), 9 + 17]
    assert kernel.supports(torch.float32, 9, 3, 64)
    assert not kernel.supports(torch.float32, 34, 2, 64)  # group of 17


def test_build_is_cached_and_keyed(kernel, tmp_path) -> None:
    first = cpu_paged_kernel.build(3, 64, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_paged_kernel.build(3, 64, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    assert list(tmp_path.iterdir()) == [first]  # no temporary left behind


def test_no_compiler_falls_back(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_paged_decode(9, 3, 64, 1) is None


def test_failed_build_leaves_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "false")  # exists, exits 1
    with pytest.raises(RuntimeError, match="failed"):
        cpu_paged_kernel.build(3, 64, tmp_path)
    assert not any(tmp_path.iterdir())


# ---- an fp8 e4m3 cache (--kv-cache-dtype fp8_e4m3) ------------------------------------


def fp8_case(page_size, heads, kv_heads, head_dim, window, extends, decodes, *, all_codes=False):
    """An fp8 cache with per-layer scales: quantized N(0, 1) pages, or (``all_codes``)
    keys all 0 and values of every non-NaN e4m3 byte, so that the output is the
    mean of the values and each byte's table entry counts."""
    spec, batch, q, k, v, float_kv = case(
        page_size, heads, kv_heads, head_dim, window, torch.float32, extends, decodes, seed=5
    )
    spec = AttentionSpec(**{**spec.__dict__, "kv_dtype": FP8_E4M3})
    scales = KvScales((0.75,), (1.5,), "checkpoint")
    kv = KvCache(
        num_layers=1, num_pages=NUM_PAGES, page_size=page_size, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=FP8_E4M3, device=CPU, scales=scales,
        compute_dtype=torch.float32,
    )  # fmt: skip
    layer = kv.layers[0]
    if all_codes:
        gen = torch.Generator().manual_seed(6)
        codes = torch.randint(0, 256, layer[:, 1].shape, generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
        layer[:, 0].view(torch.uint8).zero_()
        layer[:, 1].view(torch.uint8).copy_(codes)
        k.zero_()
    else:
        layer[:, 0] = quantize_fp8(float_kv.layers[0][:, 0], 0.75)
        layer[:, 1] = quantize_fp8(float_kv.layers[0][:, 1], 1.5)
    return spec, batch, q, k, v, kv


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    ("page_size", "heads", "kv_heads", "head_dim"), [(16, 9, 3, 64), (4, 8, 2, 128)]
)
def test_kernel_reads_an_fp8_cache_like_torch(
    kernel, page_size, heads, kv_heads, head_dim, window
) -> None:
    extends, decodes = [(3, 20), (40, 40)], [1, 17, 33, 90]  # a short extend: kernel rows
    spec, batch, q, k, v, kv = fp8_case(
        page_size, heads, kv_heads, head_dim, window, extends, decodes
    )
    library = cpu_paged_kernel.build(heads // kv_heads, head_dim)
    fast = PagedDecodeKernel(library)
    out = attend(spec, fast, batch, q, k, v, kv)
    expected = attend(spec, None, batch, q, k, v, kv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kernel_reads_every_e4m3_byte_with_its_value_scale(kernel) -> None:
    spec, batch, q, k, v, kv = fp8_case(16, 9, 3, 64, None, [], [300, 511, 64], all_codes=True)
    out = attend(spec, kernel, batch, q, k, v, kv)
    expected = attend(spec, None, batch, q, k, v, kv)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert out.abs().max() > 10  # the large codes (up to 448 x 1.5) are in there
