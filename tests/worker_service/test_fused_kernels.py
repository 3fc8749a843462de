"""FlashInfer's fused kernels (worker_service/kernels/) against the torch kernels.

On the CPU: the CUDA path's wiring. ``FlashInferKernels`` runs with FlashInfer's
kernels replaced by references written from FlashInfer's documentation
(flashinfer_fakes.py), either at the public functions our code calls ("api") or
under FlashInfer's own Python wrappers, where the compiled module would be
("kernels", bf16 only as the C++ dispatch is). Each op, tiny random Llamas
(scaled RoPE, qk-norm, biases, a head dim the fused RoPE does not take), a whole
model runner and the sampler's tokens must match the torch path; mutation checks
show that these comparisons catch a wrong argument order, a wrong in-place
assumption and a wrong cos/sin layout.

On a GPU (``-m gpu``): the real kernels against the torch ones, eagerly and
inside a CUDA graph, and the sampler's seeded tokens on CUDA against the CPU's.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker_service import flashinfer_fakes as fakes
from tests.worker_service.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.test_flashinfer_backend import flashinfer_ok, make_batch  # noqa: F401
from worker_service.attention.base import AttentionSpec
from worker_service.attention.torch_backend import TorchAttention
from worker_service.distributed import TensorParallel
from worker_service.kernels import Kernels, SamplingFilters, TorchKernels, select_kernels
from worker_service.kernels.flashinfer_kernels import FlashInferKernels
from worker_service.kv_cache import KvCache
from worker_service.model_runner import ModelCompute, ModelRunner
from worker_service.models.config import ModelConfig, RopeConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.rope import inverse_frequencies
from worker_service.plan import LogprobSpec, SamplingSpec
from worker_service.sampling.rows import SampleRow
from worker_service.sampling.sampler import Sampler

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODELS = {
    # head_dim 64 and 128 take FlashInfer's RoPE; 32 falls back to torch's.
    "llama3-h64": ModelConfig(
        "LlamaForCausalLM", 128, 256, 3, 4, 2, 64, 384, rms_norm_eps=1e-5,
        rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64), max_position_embeddings=256,
    ),
    "qwen3-qknorm-yarn-h128": ModelConfig(
        "Qwen3ForCausalLM", 128, 192, 2, 2, 1, 128, 384, qk_norm=True,
        rope=RopeConfig(10000.0, "yarn", 4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
    ),
    "gguf-freq-factors-bias-h64": ModelConfig(
        "Qwen2ForCausalLM", 128, 256, 2, 2, 2, 64, 384, qkv_bias=True,
        rope=RopeConfig(10000.0, freq_factors=tuple(np.linspace(1, 8, 32).tolist())),
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "linear-rope-h32": ModelConfig(
        "LlamaForCausalLM", 128, 256, 2, 4, 2, 32, 384,
        rope=RopeConfig(10000.0, "linear", 2.0), max_position_embeddings=256,
    ),
}  # fmt: skip

# (how FlashInfer's kernels are replaced, model dtype); "kernels" checks dtypes as
# the C++ does, which takes fp16/bf16 only.
FAKES = [("api", torch.float32), ("api", torch.bfloat16), ("kernels", torch.bfloat16)]
FAKE_IDS = [f"{how}-{str(dtype).removeprefix('torch.')}" for how, dtype in FAKES]


@contextlib.contextmanager
def install(how: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fakes in place (monkeypatch undoes them after the test); FlashInfer's
    module caches cleared after, so that no later test gets a fake module."""
    try:
        if how == "api":
            fakes.install_api(monkeypatch)
        else:
            fakes.install_kernels(monkeypatch)
        yield
    finally:
        if how == "kernels":
            fakes.clear_module_caches()


@pytest.fixture(params=FAKES, ids=FAKE_IDS)
def faked(request, monkeypatch) -> Iterator[tuple[FlashInferKernels, torch.dtype]]:
    """FlashInferKernels over fake FlashInfer kernels, and the dtype to test in."""
    how, dtype = request.param
    with install(how, monkeypatch):
        yield FlashInferKernels(), dtype


@pytest.fixture
def api_fakes(monkeypatch) -> Iterator[None]:
    with install("api", monkeypatch):
        yield


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32: the references round like the torch kernels but for op order; bf16:
    # FlashInfer rounds once where the torch path rounds twice (1-2 bf16 ulps).
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


# ---- the decision ---------------------------------------------------------------------


def test_select_kernels() -> None:
    assert select_kernels(CPU).name == "torch"
    assert select_kernels("cuda", torch.float32).name == "torch"  # no fp32 kernels
    assert select_kernels("cuda", torch.bfloat16, "torch").name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_kernels(CPU, torch.bfloat16, "flashinfer")
    with pytest.raises(ValueError, match="fp16/bf16"):
        select_kernels("cuda", torch.float32, "flashinfer")
    with pytest.raises(ValueError, match="one of"):
        select_kernels(CPU, None, "triton")
    # CUDA and bf16 with flashinfer importable (no GPU needed to build the object).
    pytest.importorskip("flashinfer")
    assert select_kernels("cuda", torch.bfloat16).name == "flashinfer"
    assert select_kernels("cuda").name == "flashinfer"  # the sampler's: no model dtype


def test_auto_falls_back_to_torch_without_flashinfer(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    assert select_kernels("cuda", torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="not importable"):
        select_kernels("cuda", torch.bfloat16, "flashinfer")


def test_the_package_does_not_import_flashinfer() -> None:
    code = (
        "import sys, worker_service.kernels, worker_service.kernels.flashinfer_kernels\n"
        "import worker_service.models.llama, worker_service.sampling.sampler\n"
        "assert 'flashinfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_cos_sin_cache_layout_and_scale() -> None:
    """(positions, D): cos of the D/2 frequencies, then their sin, scale included."""
    cfg = MODELS["qwen3-qknorm-yarn-h128"]
    model = LlamaForCausalLM(cfg, kernels=TorchKernels())
    inv_freq, scale = inverse_frequencies(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    assert scale > 1.0  # yarn's attention factor
    angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * scale
    cache = model.rope.cos_sin_cache
    assert cache.dtype == torch.float32 and cache.shape == (256, 128) and cache.is_contiguous()
    torch.testing.assert_close(cache.double(), expected, atol=1e-4, rtol=0)


# ---- each op ----------------------------------------------------------------------------


def qkv_views(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype, gen, device: torch.device = CPU
):
    """q, k, v as the model makes them: strided views of one fused projection."""
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v


def check_ops(kernels: Kernels, dtype: torch.dtype, device: torch.device = CPU) -> None:
    """Every op of ``kernels`` against the torch kernels on random inputs."""
    ref = TorchKernels()
    gen = torch.Generator().manual_seed(11)
    tol = tolerance(dtype)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x, w = rand(37, 256, scale=3.0), rand(256, scale=0.5) + 1
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), ref.rmsnorm(x, w, 1e-5), **tol)

    out, res = rand(37, 256), rand(37, 256, scale=4.0)
    want_x, want_res = ref.add_rmsnorm(out, res, w, 1e-6)
    got_x, got_res = kernels.add_rmsnorm(out.clone(), res.clone(), w, 1e-6)
    torch.testing.assert_close(got_res, want_res, **tol)
    torch.testing.assert_close(got_x, want_x, **tol)

    for heads, kv_heads, dim in [(4, 2, 64), (8, 1, 128), (2, 2, 32)]:
        views = functools.partial(qkv_views, 29, heads, kv_heads, dim, dtype, device=device)
        q, k, _ = views(torch.Generator().manual_seed(dim))
        qk_w = rand(dim, scale=0.3) + 1
        torch.testing.assert_close(
            kernels.rmsnorm(q, qk_w, 1e-6), ref.rmsnorm(q, qk_w, 1e-6), **tol
        )
        rope = RopeConfig(10000.0, "yarn", 4.0, original_max_position_embeddings=32)
        inv_freq, scale = inverse_frequencies(rope, dim, 128)
        angles = torch.arange(128, dtype=torch.float32)[:, None] * inv_freq
        cache = (torch.cat((angles.cos(), angles.sin()), dim=-1) * scale).to(device)
        positions = torch.randint(0, 128, (29,), generator=gen).to(device)
        want_q, want_k = ref.rope(positions, q, k, cache)
        # The same values in the same strided views of a second buffer (a clone of
        # a view would be contiguous), for the kernels that rotate in place.
        q2, k2, _ = views(torch.Generator().manual_seed(dim))
        got_q, got_k = kernels.rope(positions, q2, k2, cache)
        torch.testing.assert_close(got_q, want_q, **tol)
        torch.testing.assert_close(got_k, want_k, **tol)

    gate_up = rand(23, 2 * 96, scale=2.0)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)


def test_ops_match_torch(faked) -> None:
    kernels, dtype = faked
    check_ops(kernels, dtype)


def test_in_place_ops_work_in_place(api_fakes) -> None:
    """FlashInfer's add + norm and RoPE overwrite their inputs (views included)."""
    fi, gen = FlashInferKernels(), torch.Generator().manual_seed(2)
    x, res, w = torch.randn(5, 64, generator=gen), torch.randn(5, 64), torch.ones(64)
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    got_x, got_res = fi.add_rmsnorm(x, res, w, 1e-6)
    assert got_x.data_ptr() == x_ptr and got_res.data_ptr() == res_ptr
    q, k, _ = qkv_views(5, 2, 1, 64, torch.float32, gen)
    before = q.clone()
    cache = torch.rand(16, 64)
    got_q, _ = fi.rope(torch.arange(5), q, k, cache)
    assert got_q.data_ptr() == q.data_ptr() and not torch.equal(q, before)


# ---- a model ----------------------------------------------------------------------------


def tiny_model(
    name: str, dtype: torch.dtype, kernels: Kernels, device: torch.device = CPU
) -> LlamaForCausalLM:
    model = LlamaForCausalLM(MODELS[name], dtype=dtype, device=device, kernels=kernels)
    model.init_random_weights(seed=5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # norms away from 1 and biases away from 0 make them count
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.2)
    return model


def forward(model: LlamaForCausalLM, device: torch.device = CPU) -> tuple[torch.Tensor, ...]:
    """Hidden states and logits of one mixed step (two prefills, three decodes)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    batch = make_batch([(9, 9), (5, 40)], [1, 17, 33], 16, 64, gen, str(device))
    spec = AttentionSpec(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, None, model.dtype, device
    )
    attn = TorchAttention(spec)
    kv = KvCache(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim, model.dtype, device)
    for layer in kv.layers:  # the prefixes the decodes read
        layer.copy_(torch.randn(layer.shape, generator=gen).to(layer))
    attn.begin_step(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch.num_tokens,), generator=gen).to(device)
    hidden = model(ids, batch.positions, attn, kv)
    return hidden, model.logits(hidden), kv.layers[0]


def check_model(name: str, dtype: torch.dtype, kernels: Kernels) -> None:
    want = forward(tiny_model(name, dtype, TorchKernels()))
    got = forward(tiny_model(name, dtype, kernels))
    tol = tolerance(dtype)
    torch.testing.assert_close(got[2], want[2], **tol)  # keys and values (RoPE'd keys)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_torch(faked, name: str) -> None:
    kernels, dtype = faked
    check_model(name, dtype, kernels)


def test_runner_tokens_and_logprobs_match_torch(api_fakes) -> None:
    """A whole model runner (chunked prefill, a shared prefix, mixed steps, seeded
    and greedy sampling with filters): same tokens, same logprobs."""

    def run(kernels: Kernels) -> list[DriverRequest]:
        model = tiny_model("llama3-h64", torch.float32, kernels)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # sharper logits: greedy ties are fragile
        cfg = model.config
        spec = AttentionSpec(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4, None, model.dtype, CPU
        )
        kv = KvCache(cfg.num_layers, 257, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype, CPU)
        sampler = Sampler(cfg.vocab_size, CPU, seed=1, kernels=kernels)
        compute = ModelCompute(model, TorchAttention(spec), kv, sampler, TensorParallel(), CPU)
        runner = ModelRunner(compute, 256, 4, cfg.vocab_size, model.rope.max_positions)
        gen = torch.Generator().manual_seed(9)
        shared = torch.randint(0, cfg.vocab_size, (14,), generator=gen).tolist()
        lp = LogprobSpec(return_logprob=True)
        specs = [
            SamplingSpec(temperature=0.0),
            SamplingSpec(temperature=0.9, top_k=20, top_p=0.9, seed=3),
            SamplingSpec(temperature=1.2, min_p=0.05, seed=4),
            SamplingSpec(temperature=0.7, top_p=0.8, seed=5, repetition_penalty=1.3),
        ]
        reqs = [
            DriverRequest(shared + [i] * (3 + 5 * i), 12, arrive=i, sampling=s, logprobs=lp)
            for i, s in enumerate(specs)
        ]
        reqs[2].share_from = 0
        return PlanDriver(runner, 4, chunk=6).run(reqs)

    want, got = run(TorchKernels()), run(FlashInferKernels())
    for a, b in zip(want, got, strict=True):
        assert a.outputs == b.outputs
        np.testing.assert_allclose(a.logprob_values, b.logprob_values, atol=1e-5)


# ---- the sampler ------------------------------------------------------------------------

VOCAB = 3000


def sampler_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, list[SampleRow]]:
    """Logits and rows mixing greedy, filtered, seeded and unseeded rows."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    rows, logits = [], []
    for i in range(n):
        spec = SamplingSpec(
            temperature=float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])),
            top_k=int(rng.choice([-1, 1, 5, 40, 500, VOCAB, VOCAB + 7])),
            top_p=float(rng.choice([1.0, 0.95, 0.7, 0.2, 0.0])),
            min_p=float(rng.choice([0.0, 0.0, 0.02, 0.3])),
            seed=None if i % 7 == 0 else int(rng.integers(0, 2**40)),
            frequency_penalty=float(rng.choice([0.0, 0.5])),
        )
        output = rng.integers(0, VOCAB, size=int(rng.integers(0, 9))).tolist()
        rows.append(SampleRow(spec, LogprobSpec(), (), output))
        logits.append(torch.randn(VOCAB, generator=gen) * float(rng.uniform(0.5, 6.0)))
    return torch.stack(logits), rows


def check_sampler(kernels: Kernels, n: int = 600) -> None:
    logits, rows = sampler_batch(n)
    want = Sampler(VOCAB, CPU, seed=3, kernels=TorchKernels()).sample(logits, rows).token_ids
    got = Sampler(VOCAB, CPU, seed=3, kernels=kernels).sample(logits, rows).token_ids
    assert got == want, f"{sum(a != b for a, b in zip(got, want, strict=True))} of {n} differ"


@pytest.mark.parametrize("how", ["api", "kernels"])
def test_sampler_tokens_match_torch(how: str, monkeypatch) -> None:
    with install(how, monkeypatch):
        check_sampler(FlashInferKernels())


def test_fakes_and_torch_filters_keep_the_same_ties(api_fakes) -> None:
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.125, 0.125]])
    for k, p in [((2, 1), (1.0, 1.0)), ((5, 5), (0.4, 0.3)), ((4, 2), (0.5, 0.6))]:
        flt = SamplingFilters(torch.tensor(k), torch.tensor(p), torch.zeros(2), True, True, False)
        want = TorchKernels().filter_probs(probs, flt) > 0
        assert torch.equal(FlashInferKernels().filter_probs(probs, flt) > 0, want)


def test_fakes_reproduce_flashinfer_documented_examples() -> None:
    """The sampling references against the examples in FlashInfer's docstrings."""
    probs = torch.tensor(
        [
            [0.2499, 0.2592, 0.1085, 0.2718, 0.1106],
            [0.2205, 0.0942, 0.2912, 0.3452, 0.0489],
            [0.2522, 0.1602, 0.2346, 0.1532, 0.2000],
            [0.1543, 0.3182, 0.2062, 0.0958, 0.2255],
        ]
    )
    top_p = torch.tensor(
        [
            [0.0000, 0.4882, 0.0000, 0.5118, 0.0000],
            [0.0000, 0.0000, 0.0000, 1.0000, 0.0000],
            [0.5181, 0.0000, 0.4819, 0.0000, 0.0000],
            [0.0000, 1.0000, 0.0000, 0.0000, 0.0000],
        ]
    )
    top_k = torch.tensor(
        [
            [0.3201, 0.3319, 0.0000, 0.3480, 0.0000],
            [0.2573, 0.0000, 0.3398, 0.4028, 0.0000],
            [0.3672, 0.0000, 0.3416, 0.0000, 0.2912],
            [0.0000, 0.4243, 0.2750, 0.0000, 0.3007],
        ]
    )
    torch.testing.assert_close(fakes.top_p_renorm_probs(probs, 0.3), top_p, atol=2e-4, rtol=0)
    torch.testing.assert_close(fakes.top_k_renorm_probs(probs, 3), top_k, atol=2e-4, rtol=0)


# ---- mutation checks: the comparisons above catch wiring mistakes -------------------------


class SwappedAddNormArguments(FlashInferKernels):
    """fused_add_rmsnorm(residual, input, ...): the two tensors in the wrong order."""

    def add_rmsnorm(self, x, residual, weight, eps):
        self._norm.fused_add_rmsnorm(residual, x, weight, eps)
        return x, residual


class NormLandsInResidual(FlashInferKernels):
    """Believes the kernel writes the norm into ``residual`` and the sum into ``x``."""

    def add_rmsnorm(self, x, residual, weight, eps):
        self._norm.fused_add_rmsnorm(x, residual, weight, eps)
        return residual, x


class RopeOnCopies(FlashInferKernels):
    """Treats the in-place RoPE as if contiguous copies of the views were enough."""

    def rope(self, positions, q, k, cos_sin_cache):
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.contiguous(), k.contiguous(), q.shape[-1], cos_sin_cache, is_neox=True
        )
        return q, k


class RopeInterleaved(FlashInferKernels):
    """is_neox=False: GPT-J's interleaved pairs instead of HF's rotate-half."""

    def rope(self, positions, q, k, cos_sin_cache):
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, q.shape[-1], cos_sin_cache, is_neox=False
        )
        return q, k


class RopeSinThenCos(FlashInferKernels):
    """The cache's halves the other way round (sin first)."""

    def rope(self, positions, q, k, cos_sin_cache):
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
        return super().rope(positions, q, k, torch.cat((sin, cos), dim=-1))


class RenormAssumedInPlace(FlashInferKernels):
    """Drops the renorm kernels' results, as if they filtered ``probs`` in place."""

    def filter_probs(self, probs, filters):
        if filters.use_top_k:
            self._sampling.top_k_renorm_probs(probs, filters.top_k)
        if filters.use_top_p:
            self._sampling.top_p_renorm_probs(probs, filters.top_p)
        return probs


@pytest.mark.parametrize(
    "mutant",
    [SwappedAddNormArguments, NormLandsInResidual, RopeOnCopies, RopeInterleaved, RopeSinThenCos],
)
def test_model_comparison_catches(mutant, api_fakes) -> None:
    check_model("llama3-h64", torch.float32, FlashInferKernels())  # the real wiring passes
    with pytest.raises(AssertionError, match="not close"):  # the comparison, not a fake
        check_model("llama3-h64", torch.float32, mutant())


def test_sampler_comparison_catches_a_wrong_in_place_assumption(api_fakes) -> None:
    check_sampler(FlashInferKernels(), n=200)
    with pytest.raises(AssertionError, match="differ"):
        check_sampler(RenormAssumedInPlace(), n=200)


def test_fakes_catch_what_the_cpp_would_reject(monkeypatch) -> None:
    """Under FlashInfer's wrappers the fakes check as the bindings do: no fp32
    model, no float64 RoPE cache."""
    with install("kernels", monkeypatch):
        with pytest.raises(AssertionError, match="FP16"):
            check_model("llama3-h64", torch.float32, FlashInferKernels())
        q, k, _ = qkv_views(3, 2, 1, 64, torch.bfloat16, torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="float32"):
            FlashInferKernels().rope(torch.arange(3), q, k, torch.zeros(8, 64, dtype=torch.float64))


# ---- GPU: the real kernels ------------------------------------------------------------------

CUDA = torch.device("cuda")


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
