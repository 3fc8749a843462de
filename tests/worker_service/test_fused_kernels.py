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

The same checks with the real kernels on a GPU: test_fused_kernels_gpu.py.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker_service.support import flashinfer_fakes as fakes
from tests.worker_service.support.kernel_cases import (
    CPU,
    MODELS,
    check_model,
    check_ops,
    check_sampler,
    qkv_views,
    tiny_model,
)
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from worker_service.attention.base import AttentionSpec
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache
from worker_service.execution.model_compute import ModelCompute
from worker_service.execution.model_runner import ModelRunner
from worker_service.kernels import Kernels, SamplingFilters, TorchKernels, select_kernels
from worker_service.kernels.flashinfer_kernels import FlashInferKernels
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.rope import inverse_frequencies
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.sampler import Sampler

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


# ---- the decision ---------------------------------------------------------------------


def test_select_kernels() -> None:
    assert select_kernels(CPU).name == "torch"  # the sampler's: no model dtype
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
        kv = KvCache(
            num_layers=cfg.num_layers,
            num_pages=257,
            page_size=4,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=model.dtype,
            device=CPU,
        )
        sampler = Sampler(cfg.vocab_size, CPU, seed=1, kernels=kernels)
        compute = ModelCompute(
            model,
            attn=TorchAttention(spec),
            kv=kv,
            sampler=sampler,
            tp=TensorParallel(),
            device=CPU,
        )
        runner = ModelRunner(
            compute,
            num_pages=256,
            page_size=4,
            vocab_size=cfg.vocab_size,
            max_context=model.rope.max_positions,
        )
        gen = torch.Generator().manual_seed(9)
        shared = torch.randint(0, cfg.vocab_size, (14,), generator=gen).tolist()
        lp = LogprobOptions(return_logprob=True)
        specs = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3),
            SamplingParams(temperature=1.2, min_p=0.05, seed=4),
            SamplingParams(temperature=0.7, top_p=0.8, seed=5, repetition_penalty=1.3),
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
