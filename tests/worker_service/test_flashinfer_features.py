"""The attention features through our FlashInfer backend on the CPU harness
(flashinfer_cpu_harness.py: FlashInfer's real wrappers over reference modules
that model soft-capped and windowed kernels): the soft cap, the softmax scale and
the window reach FlashInfer as its wrappers' own ``logits_soft_cap``, ``sm_scale``
and ``window_left``, eager and in decode / verify CUDA graphs, and the outputs
equal the plain explicit softmax (support/attention_reference.py) on mixed
batches at page sizes 1 and 16, on the CUDA-core and the tensor-core decode
kernels. Sinks: the installed FlashInfer's FA2 path drops them (shown through its
real wrapper), so the backend refuses them and the start-time choice
(test_attention_choice.py) runs sink models on the torch backend."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import make_batch
from tests.worker_service.support.attention_reference import (
    Features,
    random_sinks,
    reference_attention,
)
from tests.worker_service.support.flashinfer_conformance import (
    like_the_runner,
    random_caches,
    random_qkv,
    seed,
)
from worker_service.attention.base import AttentionSpec
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.execution.cuda_graphs import DecodeGraphs, pad_verify_batch

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer-python is not installed (make setup installs it without CUDA deps)",
)

HEADS = (4, 2, 256)  # Gemma 2's head dim, GQA group 2 (the CUDA-core decode kernel)
EXTENDS = [(40, 40), (20, 53), (3, 30)]
DECODES = [1, 9, 33, 70]
CASES = [
    Features(soft_cap=5.0),
    Features(scale=0.1),
    Features(window=8),
    Features(soft_cap=5.0, scale=0.1, window=8),
]
TOL = {"atol": 3e-2, "rtol": 3e-2}  # bf16 inputs against a float64 reference


def spec_with(features: Features, page_size: int) -> AttentionSpec:
    return AttentionSpec(
        *HEADS,
        page_size,
        features.window,
        torch.bfloat16,
        torch.device("cpu"),
        logit_soft_cap=features.soft_cap,
        softmax_scale=features.scale,
    )


def scaled_qkv(spec: AttentionSpec, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Queries large enough that the cap (5) bends the scores."""
    q, k, v = random_qkv(spec, tokens, gen)
    return [(q.float() * 3).to(spec.dtype), k, v]


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("features", CASES, ids=lambda f: f.name)
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_core", "tensor_core"])
def test_features_match_the_plain_softmax(page_size, features, tensor_cores) -> None:
    gen = seed("features", page_size, features.name, tensor_cores)
    num_pages = 512 // page_size
    spec = spec_with(features, page_size)
    batch = like_the_runner(make_batch(EXTENDS, DECODES, page_size, num_pages, gen))
    fi = FlashInferAttention(spec, workspace_bytes=2**20, decode_tensor_cores=tensor_cores)
    kv, _ = random_caches(spec, num_pages, gen)
    fi.begin_step(batch)
    q, k, v = scaled_qkv(spec, batch.num_tokens, gen)
    out = fi.forward(0, q, k, v, kv=kv)
    expected = reference_attention(batch, q.float(), kv, 0, features=features, sinks=None)
    torch.testing.assert_close(out.double(), expected, **TOL)
    assert reference.CALLS["decode.run"] == (0 if tensor_cores else 1)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
def test_soft_capped_decode_and_verify_graphs(monkeypatch, page_size) -> None:
    """The graph wrappers are planned with the cap, scale and window too: replays
    equal the plain softmax."""
    features = CASES[-1]
    spec = spec_with(features, page_size)
    gen = seed("feature graphs", page_size)
    num_pages = 512 // page_size
    scratch = num_pages - 1
    harness.install_graph_stand_ins(monkeypatch)
    kv, _ = random_caches(spec, num_pages, gen)
    graphed = FlashInferAttention(spec, workspace_bytes=2**20)
    graphed.enable_decode_graphs(scratch, -(-200 // page_size), sizes=(4, 8))
    rows = 4
    graphed.enable_verify_graphs(rows, sizes=(2, 4))
    bufs = dict(zip("qkv", scaled_qkv(spec, 4 * rows, gen), strict=True))

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        out = graphed.forward(0, x["q"], x["k"], x["v"], kv=kv)
        held = torch.empty_like(out)
        harness.launch(lambda: held.copy_(out))
        return held

    decode_graphs = DecodeGraphs(graphed, forward, bufs, page_size)
    decode_graphs.capture()
    verify_graphs = DecodeGraphs(graphed.verify_graphs, forward, bufs, page_size, rows_per_seq=rows)
    verify_graphs.capture()

    batch = like_the_runner(make_batch([], [40, 3, 17, 9, 70], page_size, num_pages, gen))
    q, k, v = scaled_qkv(spec, batch.num_tokens, gen)
    out = decode_graphs.replay(batch, {"q": q, "k": k, "v": v})
    assert out is not None
    expected = reference_attention(batch, q.float(), kv, 0, features=features, sinks=None)
    torch.testing.assert_close(out.double(), expected, **TOL)

    drafted = like_the_runner(make_batch([(4, 20), (2, 33)], [16], page_size, num_pages, gen))
    q, k, v = scaled_qkv(spec, drafted.num_tokens, gen)
    ids = torch.arange(drafted.num_tokens)
    padded, _, dest = pad_verify_batch(drafted, ids, rows_per_seq=rows, scratch_page=scratch)
    where = torch.from_numpy(dest)
    inputs = {}
    for name, t in zip("qkv", (q, k, v), strict=True):
        inputs[name] = torch.zeros(padded.num_tokens, *t.shape[1:], dtype=t.dtype)
        inputs[name][where] = t
    out = verify_graphs.replay(padded, inputs)
    assert out is not None
    expected = reference_attention(drafted, q.float(), kv, 0, features=features, sinks=None)
    torch.testing.assert_close(out[where].double(), expected, **TOL)


@pytest.mark.usefixtures("fi_cpu")
def test_the_backend_refuses_sinks() -> None:
    gen = seed("sinks refused")
    spec = spec_with(Features(), 16)
    fi = FlashInferAttention(spec, workspace_bytes=2**20)
    batch = like_the_runner(make_batch(EXTENDS, DECODES, 16, 32, gen))
    kv, _ = random_caches(spec, 32, gen)
    fi.begin_step(batch)
    with pytest.raises(ValueError, match="sinks"):
        fi.forward(0, *random_qkv(spec, batch.num_tokens, gen), kv=kv, sinks=random_sinks(4, gen))


@pytest.mark.usefixtures("fi_cpu")
def test_flashinfers_fa2_prefill_wrapper_drops_sinks() -> None:
    """Why the backend refuses sinks: the installed FlashInfer's paged prefill
    wrapper takes ``sinks`` in ``run`` and hands the FA2 module a call without
    them, so the output is the sink-free one (the reference module would fail a
    call it could not model)."""
    gen = seed("sinks dropped")
    spec = spec_with(Features(), 16)
    batch = like_the_runner(make_batch([(20, 20)], [], 16, 32, gen))
    kv, _ = random_caches(spec, 32, gen)
    fi = FlashInferAttention(spec, workspace_bytes=2**20)
    fi.begin_step(batch)
    q, k, v = random_qkv(spec, batch.num_tokens, gen)
    plain = fi.forward(0, q, k, v, kv=kv)
    wrapper = fi._active_prefill
    with_sinks = wrapper.run(q, kv.layers[0], sinks=random_sinks(4, gen) + 5)
    assert torch.equal(with_sinks, plain)
