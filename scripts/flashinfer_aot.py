"""Compile ahead of time the FlashInfer modules the worker loads on CUDA: the
attention modules of FlashInferAttention and the op modules of FlashInferKernels
(RMSNorm and fused add + RMSNorm, RoPE from a cos/sin cache, SiLU-and-mul, the
top-k / top-p renorm filters), and put each at OUT/<name>/<name>.so (FlashInfer's
data/aot layout, which it loads before trying to JIT-compile).

Used by scripts/build_flashinfer_bundle.sh and docker/Dockerfile.cuda. Knobs (env):
FI_DTYPES ("bfloat16"), FI_HEAD_DIMS ("64 128"), FI_PREFILL_BACKENDS ("fa2"; add
fa3 for prefill_backend="auto"/"fa3" on Hopper), FLASHINFER_CUDA_ARCH_LIST.

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


def op_specs() -> Iterator[object]:
    """worker_service/kernels/flashinfer_kernels.py's modules: one each, every dtype
    and head dim inside (the getters flashinfer.norm.get_norm_module, rope's
    get_rope_module, get_act_and_mul_module("silu") and get_sampling_module build
    exactly these)."""
    yield gen_norm_module()
    yield gen_rope_module()
    yield gen_act_and_mul_module("silu")
    yield gen_sampling_module()


def attention_specs() -> Iterator[object]:
    # The decode wrappers use backend="fa2" (tensor-core decode runs the fa2
    # prefill module); prefill uses the FI_PREFILL_BACKENDS.
    backends = os.environ.get("FI_PREFILL_BACKENDS", "fa2").split()
    for dtype in os.environ.get("FI_DTYPES", "bfloat16").split():
        dt = getattr(torch, dtype)
        for hd in map(int, os.environ.get("FI_HEAD_DIMS", "64 128").split()):
            for swa in (False, True):
                a = (dt, dt, dt, torch.int32, hd, hd, 0, swa, False)
                yield m.gen_batch_decode_module(*a)
                yield m._gen_batch_prefill_primary_module("fa2", *a, False)
                if "fa3" in backends:
                    yield m.gen_batch_prefill_module("fa3", *a, False)


def specs() -> Iterator[object]:
    yield from attention_specs()
    yield from op_specs()


def main(out: pathlib.Path) -> None:
    todo = list(specs())
    build_jit_specs(todo, verbose=False, skip_prebuilt=False)
    for spec in todo:
        (out / spec.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, out / spec.name / f"{spec.name}.so")
        print("  built", spec.name)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
