"""Compile ahead of time the FlashInfer modules the worker loads on CUDA: the
attention modules of FlashInferAttention and the op modules of FlashInferKernels
(RMSNorm and fused add + RMSNorm, RoPE from a cos/sin cache, SiLU-and-mul, the
top-k / top-p renorm filters), put each at OUT/<name>/<name>.so (FlashInfer's
data/aot layout, which it loads before trying to JIT-compile), and write
OUT/radixserve_kernels.json, the manifest the worker checks a model against at
start (worker_service/attention/flashinfer_modules.py: the list is data there).

Used by scripts/build_flashinfer_bundle.sh and docker/Dockerfile.cuda. Knobs (env):
FI_DTYPES ("bfloat16 float16"), FI_HEAD_DIMS ("64 128 256"), FI_PREFILL_BACKENDS
("fa2"; add fa3 for prefill_backend="auto"/"fa3" on Hopper), the soft-capped
modules' FI_SOFTCAP_DTYPES ("bfloat16") and FI_SOFTCAP_HEAD_DIMS ("256"; "none"
for none), the fp8-KV-cache modules' FI_FP8KV_DTYPES ("": none; "bfloat16")
and FI_FP8KV_HEAD_DIMS ("128"), FLASHINFER_CUDA_ARCH_LIST.

Usage: python scripts/flashinfer_aot.py OUT
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
from collections.abc import Iterator

import torch
from flashinfer.jit.activation import gen_act_and_mul_module
from flashinfer.jit.attention import modules as m
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit.norm import gen_norm_module
from flashinfer.jit.rope import gen_rope_module
from flashinfer.jit.sampling import gen_sampling_module

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from worker_service.attention.flashinfer_modules import (
    DEFAULT_DTYPES,
    DEFAULT_FP8KV_DTYPES,
    DEFAULT_FP8KV_HEAD_DIMS,
    DEFAULT_HEAD_DIMS,
    DEFAULT_SOFTCAP_DTYPES,
    DEFAULT_SOFTCAP_HEAD_DIMS,
    MANIFEST_NAME,
    OP_MODULES,
    AttentionModule,
    Manifest,
    build_list,
)


def op_specs() -> Iterator[object]:
    """worker_service/kernels/flashinfer_kernels.py's modules: one each, every dtype
    and head dim inside (the getters flashinfer.norm.get_norm_module, rope's
    get_rope_module, get_act_and_mul_module("silu") / ("gelu_tanh") and
    get_sampling_module build exactly these)."""
    yield gen_norm_module()
    yield gen_rope_module()
    yield gen_act_and_mul_module("silu")
    yield gen_act_and_mul_module("gelu_tanh")
    yield gen_sampling_module()


def attention_modules() -> list[AttentionModule]:
    dtypes = os.environ.get("FI_DTYPES", "").split() or DEFAULT_DTYPES
    head_dims = [int(d) for d in os.environ.get("FI_HEAD_DIMS", "").split()] or DEFAULT_HEAD_DIMS
    cap_dtypes = os.environ.get("FI_SOFTCAP_DTYPES", "").split() or DEFAULT_SOFTCAP_DTYPES
    cap_dims_env = os.environ.get("FI_SOFTCAP_HEAD_DIMS", "").split()
    cap_dims: tuple[int, ...] = DEFAULT_SOFTCAP_HEAD_DIMS
    if cap_dims_env:
        cap_dims = () if cap_dims_env == ["none"] else tuple(int(d) for d in cap_dims_env)
    fp8_dtypes = os.environ.get("FI_FP8KV_DTYPES", "").split() or DEFAULT_FP8KV_DTYPES
    fp8_dims_env = os.environ.get("FI_FP8KV_HEAD_DIMS", "").split()
    fp8_dims = tuple(int(d) for d in fp8_dims_env) or DEFAULT_FP8KV_HEAD_DIMS
    return build_list(
        dtypes,
        head_dims,
        os.environ.get("FI_PREFILL_BACKENDS", "fa2").split(),
        soft_cap_dtypes=cap_dtypes,
        soft_cap_head_dims=cap_dims,
        fp8_kv_dtypes=fp8_dtypes,
        fp8_kv_head_dims=fp8_dims,
    )


def attention_spec(module: AttentionModule) -> object:
    """FlashInfer's JitSpec for ``module``, the one its wrappers' plan() looks up."""
    dt = getattr(torch, module.dtype)
    kv = getattr(torch, module.kv_dtype or module.dtype)
    hd = module.head_dim
    a = (dt, kv, dt, torch.int32, hd, hd, 0, module.sliding_window, module.soft_cap)
    if module.kind == "decode":
        spec = m.gen_batch_decode_module(*a)
    elif module.backend == "fa2":
        spec = m._gen_batch_prefill_primary_module("fa2", *a, False)
    else:
        spec = m.gen_batch_prefill_module(module.backend, *a, False)
    # The worker checks for these names at start: a FlashInfer that names its
    # modules otherwise fails the build here, not the worker there.
    assert spec.name == module.name, (spec.name, module.name)
    return spec


def main(out: pathlib.Path) -> None:
    modules = attention_modules()
    todo = [attention_spec(a) for a in modules] + list(op_specs())
    assert [s.name for s in todo[len(modules) :]] == list(OP_MODULES)
    build_jit_specs(todo, verbose=False, skip_prebuilt=False)
    for spec in todo:
        (out / spec.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, out / spec.name / f"{spec.name}.so")
        print("  built", spec.name)
    import flashinfer

    manifest = Manifest(
        flashinfer.__version__,
        os.environ.get("FLASHINFER_CUDA_ARCH_LIST", ""),
        tuple(modules),
        OP_MODULES,
    )
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    print(f"  manifest {out / MANIFEST_NAME}: {manifest.summary()}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
