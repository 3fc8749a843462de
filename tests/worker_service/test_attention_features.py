"""The attention features some families need (AttentionSpec.logit_soft_cap and
softmax_scale, forward's ``sinks``, sliding windows) through the torch backend,
with and without the CPU decode kernel, against a plain explicit softmax
(support/attention_reference.py) on mixed batches: long extends (SDPA's path),
short extends and decodes (the kernel's rows, or the gather path without it),
page sizes 1 and 16. Without the features, the backend's outputs stay the SDPA
path's to the bit."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.attention_batches import make_batch
from tests.worker_service.support.attention_reference import (
    Features,
    random_sinks,
    reference_attention,
)
from worker_service.attention import torch_backend
from worker_service.attention.base import AttentionSpec
from worker_service.attention.cpu_paged_kernel import PagedDecodeKernel, load_paged_decode
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache

CPU = torch.device("cpu")
HEADS = (4, 2, 64)  # GQA group 2
NUM_PAGES = 256
# (q_len, kv_len) extends: a whole prompt, a long chunk after a prefix (SDPA's
# path), a short chunk (the kernel's rows); then decodes.
EXTENDS = [(40, 40), (20, 53), (3, 30)]
DECODES = [1, 9, 33, 70]
CASES = [
    Features(soft_cap=5.0),
    Features(scale=0.3),
    Features(sinks=True),
    Features(window=8),
    Features(soft_cap=5.0, scale=0.3, sinks=True, window=8),
]


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    k = load_paged_decode(*HEADS, 1)
    assert k is not None, "the kernel must build on the CI machine (gcc is there)"
    return k


def setup(features: Features, page_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(
        *HEADS,
        page_size,
        features.window,
        torch.float32,
        CPU,
        logit_soft_cap=features.soft_cap,
        softmax_scale=features.scale,
    )
    kv = KvCache(
        num_layers=1,
        num_pages=NUM_PAGES,
        page_size=page_size,
        num_kv_heads=HEADS[1],
        head_dim=HEADS[2],
        dtype=torch.float32,
        device=CPU,
    )
    # Scores of a few units: the cap (5) bends them, the sinks compete with them.
    kv.layers[0].copy_(torch.randn(kv.layers[0].shape, generator=gen) * 2)
    batch = make_batch(EXTENDS, DECODES, page_size, NUM_PAGES, gen)
    t = batch.num_tokens
    q = torch.randn(t, HEADS[0], HEADS[2], generator=gen) * 2
    k = torch.randn(t, HEADS[1], HEADS[2], generator=gen)
    v = torch.randn(t, HEADS[1], HEADS[2], generator=gen)
    sinks = random_sinks(HEADS[0], gen) if features.sinks else None
    return spec, batch, q, k, v, kv, sinks


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("features", CASES, ids=lambda f: f.name)
@pytest.mark.parametrize("with_kernel", [False, True], ids=["gather", "kernel"])
def test_torch_backend_matches_the_plain_softmax(features, page_size, with_kernel, kernel):
    spec, batch, q, k, v, kv, sinks = setup(features, page_size)
    attn = TorchAttention(spec, kernel if with_kernel else None)
    assert (attn.decode_kernel is not None) == with_kernel
    attn.begin_step(batch)
    out = attn.forward(0, q, k, v, kv=kv, sinks=sinks)
    expected = reference_attention(batch, q, kv, 0, features=features, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_features_off_keep_the_sdpa_path_bit_identical(monkeypatch, page_size, kernel):
    """Without a cap or sinks no row takes the explicit softmax: every path is
    SDPA's (or the kernel's) as before, and a spec that names the default scale
    gives the same bits as one that leaves it out."""

    def refused(*args, **kwargs):
        raise AssertionError("the explicit softmax ran without a cap or sinks")

    monkeypatch.setattr(torch_backend, "manual_attention", refused)
    spec, batch, q, k, v, kv, _ = setup(Features(window=8), page_size)
    named = AttentionSpec(*HEADS, page_size, 8, torch.float32, CPU, softmax_scale=HEADS[2] ** -0.5)
    for dk in (None, kernel):
        plain, same = TorchAttention(spec, dk), TorchAttention(named, dk)
        plain.begin_step(batch)
        same.begin_step(batch)
        a = plain.forward(0, q, k, v, kv=kv)
        b = same.forward(0, q, k, v, kv=kv, sinks=None)
        assert torch.equal(a, b)


def test_kernel_rows_take_the_features_in_bf16(kernel):
    """The kernel's bf16 path: same features, bf16 tolerance."""
    features = CASES[-1]
    _, batch, q, k, v, kv, sinks = setup(features, 16, seed=1)
    spec16 = AttentionSpec(
        *HEADS,
        16,
        features.window,
        torch.bfloat16,
        CPU,
        logit_soft_cap=features.soft_cap,
        softmax_scale=features.scale,
    )
    kv16 = KvCache(
        num_layers=1,
        num_pages=NUM_PAGES,
        page_size=16,
        num_kv_heads=HEADS[1],
        head_dim=HEADS[2],
        dtype=torch.bfloat16,
        device=CPU,
    )
    kv16.layers[0].copy_(kv.layers[0].to(torch.bfloat16))
    attn = TorchAttention(spec16, kernel)
    attn.begin_step(batch)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    out = attn.forward(0, q16, k16, v16, kv=kv16, sinks=sinks)
    expected = reference_attention(batch, q16.float(), kv16, 0, features=features, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("with_kernel", [False, True], ids=["gather", "kernel"])
def test_long_extends_attend_in_blocks_of_queries(monkeypatch, with_kernel, kernel):
    """The explicit softmax's scores are bounded: a long extend attends in blocks
    of queries (here of 3), with the same outputs."""
    from worker_service.attention import torch_backend as backend

    monkeypatch.setattr(backend, "MANUAL_BLOCK_SCORES", 3 * HEADS[0] * 53)
    rows: list[int] = []
    real = backend.manual_attention

    def recorded(q, *args, **kwargs):
        rows.append(q.shape[-2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(backend, "manual_attention", recorded)
    features = CASES[-1]
    spec, batch, q, k, v, kv, sinks = setup(features, 16)
    attn = TorchAttention(spec, kernel if with_kernel else None)
    attn.begin_step(batch)
    out = attn.forward(0, q, k, v, kv=kv, sinks=sinks)
    assert max(rows) <= 3 and len(rows) >= (40 + 20) // 3
    expected = reference_attention(batch, q, kv, 0, features=features, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_kernel_takes_the_features_on_threads():
    """The threaded build (OpenMP, or a Python pool) hands every task the cap and sinks."""
    threaded = load_paged_decode(*HEADS, 2)
    assert threaded is not None and threaded.threads == 2
    features = CASES[-1]
    spec, batch, q, k, v, kv, sinks = setup(features, 16, seed=2)
    attn = TorchAttention(spec, threaded)
    attn.begin_step(batch)
    out = attn.forward(0, q, k, v, kv=kv, sinks=sinks)
    expected = reference_attention(batch, q, kv, 0, features=features, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_kernel_refuses_misshapen_sinks(kernel):
    spec, batch, q, k, v, kv, _ = setup(Features(sinks=True), 16)
    attn = TorchAttention(spec, kernel)
    attn.begin_step(batch)
    with pytest.raises(ValueError, match="sinks must be"):
        attn.forward(0, q, k, v, kv=kv, sinks=torch.zeros(HEADS[0] + 1))
