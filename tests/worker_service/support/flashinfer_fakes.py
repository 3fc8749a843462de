"""Reference implementations of the FlashInfer kernels our code calls, written from
FlashInfer's documentation and sources (0.7.2.post1), not from our torch kernels,
so that the CUDA path's wiring runs on a CPU.

Two ways in, both through ``monkeypatch``:

- ``install_api``: FlashInfer's public functions that ``FlashInferKernels`` calls
  (``flashinfer.norm.rmsnorm``, ...) replaced by these references;
- ``install_kernels``: FlashInfer's own Python wrappers kept, the compiled
  modules under them (``get_norm_module()``, ...) replaced, with the checks the
  C++ bindings make (dtypes, dims, contiguity): what our calls go through on a
  GPU, but the kernel itself.

What they compute, per FlashInfer:

- rmsnorm: ``out = input / RMS(input) * weight`` in float32, one rounding;
  (B, D) or (B, H, D) input;
- fused_add_rmsnorm: ``residual += input`` (rounded to its dtype), then
  ``input = norm(the float32 sum) * weight``; both in place, returns None;
- apply_rope_with_cos_sin_cache_inplace: cache (max_pos, R) float32, cos in the
  first R/2 columns, sin in the last; ``is_neox`` rotates the halves of the
  first R dims, else interleaved (even, odd) pairs; q and k viewed as
  (nnz, -1, head_size) and overwritten;
- silu_and_mul: ``silu(x[..., :d]) * x[..., d:]``, float32 math, one rounding;
  gelu_tanh_and_mul the same with the tanh GELU;
- gemma_rmsnorm / gemma_fused_add_rmsnorm: rmsnorm / fused_add_rmsnorm with
  ``1 + weight`` (float32) in place of the weight; (B, D) input only;
- top_k_renorm_probs: keep probs >= the k-th largest of the row (ties kept; k
  at or beyond the vocabulary keeps all), renormalise; a new tensor;
- top_p_renorm_probs: keep probs >= the first value, in descending order, at
  which the cumulative mass reaches top_p * the row's mass (ties kept; top_p
  >= 1 keeps all), renormalise; a new tensor.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


# ---- the arithmetic ---------------------------------------------------------------


def rmsnorm_math(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rms_rcp = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rms_rcp * weight.float()


def rope_math(
    x: torch.Tensor, cos_sin_cache: torch.Tensor, pos_ids: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x (nnz, H, D) rotated in its first R dims, R = cache columns."""
    rot = cos_sin_cache.shape[1]
    cos = cos_sin_cache[pos_ids, : rot // 2].unsqueeze(1)
    sin = cos_sin_cache[pos_ids, rot // 2 :].unsqueeze(1)
    x32 = x.float()
    out = x32.clone()
    if interleave:
        even, odd = x32[..., 0:rot:2], x32[..., 1:rot:2]
        out[..., 0:rot:2] = even * cos - odd * sin
        out[..., 1:rot:2] = odd * cos + even * sin
    else:
        first, second = x32[..., : rot // 2], x32[..., rot // 2 : rot]
        out[..., : rot // 2] = first * cos - second * sin
        out[..., rot // 2 : rot] = second * cos + first * sin
    return out.to(x.dtype)


def gelu_tanh_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    cdf = 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
    return (a * cdf * b).to(x.dtype)


def silu_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    return (a / (1.0 + torch.exp(-a)) * b).to(x.dtype)


def _per_row(value: torch.Tensor | float, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        assert value.shape == (rows,), f"per-row parameter of shape {tuple(value.shape)}"
        return value.to(dtype)
    return torch.full((rows,), value, dtype=dtype)


def top_k_renorm_math(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = probs.shape[1]
    assert (top_k != 0).all(), "top_k 0 is outside (0, vocab]"
    keep_all = (top_k < 0) | (top_k >= vocab)  # a negative k is a huge uint32 there
    k = torch.where(keep_all, vocab, top_k).long()
    kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_math(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p = probs.sort(dim=-1, descending=True).values
    cum = sorted_p.cumsum(dim=-1)
    target = top_p.unsqueeze(1) * probs.sum(dim=-1, keepdim=True)
    first = (cum < target).sum(dim=1, keepdim=True).clamp(max=probs.shape[1] - 1)
    threshold = sorted_p.gather(1, first)
    threshold = torch.where(top_p.unsqueeze(1) >= 1.0, 0.0, threshold)
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


# ---- FlashInfer's public functions ------------------------------------------------


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    assert input.dim() in (2, 3) and weight.dim() == 1 and input.shape[-1] == weight.shape[0]
    assert input.dtype == weight.dtype, (input.dtype, weight.dtype)
    if out is None:
        out = torch.empty_like(input)
    out.copy_(rmsnorm_math(input.float(), weight, eps))
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None) -> None:
    assert input.dim() == 2 and residual.shape == input.shape and weight.dim() == 1
    assert input.dtype == residual.dtype == weight.dtype
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(rmsnorm_math(total, weight, eps))


def apply_rope_with_cos_sin_cache_inplace(
    positions, query, key, head_size, cos_sin_cache, is_neox=True
) -> None:
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    q = query.view(query.shape[0], -1, head_size)
    k = key.view(key.shape[0], -1, head_size)
    assert q.shape[0] == k.shape[0] == positions.shape[0]
    q.copy_(rope_math(q, cos_sin_cache, positions, not is_neox))
    k.copy_(rope_math(k, cos_sin_cache, positions, not is_neox))


def silu_and_mul(input, out=None, enable_pdl=None):
    assert input.shape[-1] % 2 == 0
    result = silu_and_mul_math(input)
    if out is None:
        return result
    out.copy_(result)
    return out


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    assert input.shape[-1] % 2 == 0
    result = gelu_tanh_and_mul_math(input)
    if out is None:
        return result
    out.copy_(result)
    return out


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    # csrc/norm.cu: CHECK_DIM(2, input), unlike rmsnorm's (B, D) or (B, H, D).
    assert input.dim() == 2 and weight.dim() == 1 and input.shape[-1] == weight.shape[0]
    assert input.dtype == weight.dtype, (input.dtype, weight.dtype)
    if out is None:
        out = torch.empty_like(input)
    out.copy_(rmsnorm_math(input.float(), 1.0 + weight.float(), eps))
    return out


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None) -> None:
    assert input.dim() == 2 and residual.shape == input.shape and weight.dim() == 1
    assert input.dtype == residual.dtype == weight.dtype
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(rmsnorm_math(total, 1.0 + weight.float(), eps))


def top_k_renorm_probs(probs, top_k, is_deterministic=False):
    assert probs.dim() == 2 and probs.dtype in (torch.float32, *HALF_DTYPES)
    return top_k_renorm_math(probs, _per_row(top_k, probs.shape[0], torch.int64))


def top_p_renorm_probs(probs, top_p, is_deterministic=False):
    assert probs.dim() == 2
    return top_p_renorm_math(probs.float(), _per_row(top_p, probs.shape[0], torch.float32))


def install_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope
    import flashinfer.sampling

    for module, name, fake in [
        (flashinfer.norm, "rmsnorm", rmsnorm),
        (flashinfer.norm, "fused_add_rmsnorm", fused_add_rmsnorm),
        (
            flashinfer.rope,
            "apply_rope_with_cos_sin_cache_inplace",
            apply_rope_with_cos_sin_cache_inplace,
        ),
        (flashinfer.activation, "silu_and_mul", silu_and_mul),
        (flashinfer.activation, "gelu_tanh_and_mul", gelu_tanh_and_mul),
        (flashinfer.norm, "gemma_rmsnorm", gemma_rmsnorm),
        (flashinfer.norm, "gemma_fused_add_rmsnorm", gemma_fused_add_rmsnorm),
        (flashinfer.sampling, "top_k_renorm_probs", top_k_renorm_probs),
        (flashinfer.sampling, "top_p_renorm_probs", top_p_renorm_probs),
    ]:
        monkeypatch.setattr(module, name, fake)


# ---- the compiled modules under FlashInfer's wrappers -----------------------------
# The functions of the .so FlashInfer would build (csrc/*.cu bindings): same names,
# same arguments, the checks the C++ makes; the outputs written in place.


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "CHECK_LAST_DIM_CONTIGUOUS"


def _contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.is_contiguous(), "CHECK_INPUT (contiguous)"


def _half(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype in HALF_DTYPES, f"DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16 got {t.dtype}"


def _row_param(param: torch.Tensor | None, probs: torch.Tensor, dtype: torch.dtype) -> None:
    if param is not None:  # check_tensor_param, then read as int* / float*
        assert param.dim() == 1 and param.shape[0] == probs.shape[0] and param.dtype == dtype


def _norm_cpp() -> SimpleNamespace:
    def rmsnorm_cpp(output, input, weight, eps, enable_pdl) -> None:
        _last_dim_contiguous(input, output, weight)
        _half(input, weight)
        assert input.dim() in (2, 3) and output.shape == input.shape and weight.dim() == 1
        output.copy_(rmsnorm_math(input.float(), weight, eps))

    def fused_add_rmsnorm_cpp(input, residual, weight, eps, enable_pdl) -> None:
        _last_dim_contiguous(input, residual, weight)
        _half(input, residual, weight)
        assert input.dim() == 2 and residual.shape == input.shape and weight.dim() == 1
        fused_add_rmsnorm(input, residual, weight, eps)

    def gemma_rmsnorm_cpp(output, input, weight, eps, enable_pdl) -> None:
        _last_dim_contiguous(input, weight)
        _half(input, weight)
        assert input.dim() == 2 and output.shape == input.shape and weight.dim() == 1
        output.copy_(rmsnorm_math(input.float(), 1.0 + weight.float(), eps))

    def gemma_fused_add_rmsnorm_cpp(input, residual, weight, eps, enable_pdl) -> None:
        _last_dim_contiguous(input, residual, weight)
        _half(input, residual, weight)
        assert input.dim() == 2 and residual.shape == input.shape and weight.dim() == 1
        gemma_fused_add_rmsnorm(input, residual, weight, eps)

    return SimpleNamespace(
        rmsnorm=rmsnorm_cpp,
        fused_add_rmsnorm=fused_add_rmsnorm_cpp,
        gemma_rmsnorm=gemma_rmsnorm_cpp,
        gemma_fused_add_rmsnorm=gemma_fused_add_rmsnorm_cpp,
    )


def _rope_cpp() -> SimpleNamespace:
    def apply_rope_pos_ids_cos_sin_cache(
        q, k, q_rope, k_rope, cos_sin_cache, pos_ids, interleave
    ) -> None:
        _last_dim_contiguous(q, k)
        _contiguous(cos_sin_cache, pos_ids)
        _half(q, k)
        assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2
        assert pos_ids.dtype in (torch.int32, torch.int64)
        assert q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
        assert q.shape[2] >= cos_sin_cache.shape[1], "head_dim must be >= rotary_dim"
        q_rope.copy_(rope_math(q, cos_sin_cache, pos_ids, interleave))
        k_rope.copy_(rope_math(k, cos_sin_cache, pos_ids, interleave))

    return SimpleNamespace(apply_rope_pos_ids_cos_sin_cache=apply_rope_pos_ids_cos_sin_cache)


def _silu_and_mul_cpp() -> SimpleNamespace:
    def silu_and_mul_cpp(out, input, enable_pdl) -> None:
        # The generated kernel indexes the raw buffers: rows of 2d, no strides.
        _contiguous(input, out)
        _half(input)
        out.copy_(silu_and_mul_math(input))

    return SimpleNamespace(silu_and_mul=silu_and_mul_cpp)


def _gelu_tanh_and_mul_cpp() -> SimpleNamespace:
    def gelu_tanh_and_mul_cpp(out, input, enable_pdl) -> None:
        _contiguous(input, out)
        _half(input)
        out.copy_(gelu_tanh_and_mul_math(input))

    return SimpleNamespace(gelu_tanh_and_mul=gelu_tanh_and_mul_cpp)


def _sampling_cpp() -> SimpleNamespace:
    def top_k_renorm_cpp(
        probs, renorm_probs, maybe_top_k_arr, top_k_val, is_deterministic, row_states_buffer
    ) -> None:
        _contiguous(probs, row_states_buffer)
        _row_param(maybe_top_k_arr, probs, torch.int32)
        k = maybe_top_k_arr if maybe_top_k_arr is not None else top_k_val
        renorm_probs.copy_(top_k_renorm_math(probs, _per_row(k, probs.shape[0], torch.int64)))

    def top_p_renorm_cpp(
        probs, renorm_probs, maybe_top_p_arr, top_p_val, is_deterministic, workspace
    ) -> None:
        _contiguous(probs)
        assert probs.dtype == torch.float32, "the binding reads probs as float*"
        _row_param(maybe_top_p_arr, probs, torch.float32)
        p = maybe_top_p_arr if maybe_top_p_arr is not None else top_p_val
        renorm_probs.copy_(top_p_renorm_math(probs, _per_row(p, probs.shape[0], torch.float32)))

    return SimpleNamespace(top_k_renorm_probs=top_k_renorm_cpp, top_p_renorm_probs=top_p_renorm_cpp)


class _BuiltSpec:
    """Stands for a JitSpec whose module is already built."""

    def __init__(self, module: SimpleNamespace) -> None:
        self.module = module

    def build_and_load(self) -> SimpleNamespace:
        return self.module


def _module_caches() -> list:
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope
    import flashinfer.sampling

    return [
        flashinfer.norm.get_norm_module,
        flashinfer.rope.get_rope_module,
        flashinfer.activation.get_act_and_mul_module,
        flashinfer.sampling.get_sampling_module,
    ]


def clear_module_caches() -> None:
    """FlashInfer caches its loaded modules: clear them when installing the fakes
    and again after the test, or a later GPU test would get a fake."""
    for getter in _module_caches():
        getter.cache_clear()


def install_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Call ``clear_module_caches`` after the test."""
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope
    import flashinfer.sampling

    norm, rope, act, sampling = _norm_cpp(), _rope_cpp(), _silu_and_mul_cpp(), _sampling_cpp()

    acts = {"silu": act, "gelu_tanh": _gelu_tanh_and_mul_cpp()}

    def act_spec(name: str) -> _BuiltSpec:
        return _BuiltSpec(acts[name])

    # The CUDA JIT norm module, not the CuTe DSL one (which the GPU bundle lacks).
    monkeypatch.setattr(flashinfer.norm, "_USE_CUDA_NORM", True)
    monkeypatch.setattr(flashinfer.norm, "gen_norm_module", lambda: _BuiltSpec(norm))
    monkeypatch.setattr(flashinfer.rope, "gen_rope_module", lambda: _BuiltSpec(rope))
    monkeypatch.setattr(flashinfer.activation, "gen_act_and_mul_module", act_spec)
    monkeypatch.setattr(flashinfer.sampling, "gen_sampling_module", lambda: _BuiltSpec(sampling))
    clear_module_caches()
