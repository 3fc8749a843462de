#!/usr/bin/env bash
# Build .fi_bundle/: what an offline GPU machine (x86-64, CPython 3.12, torch for
# CUDA 13, no flashinfer, no network) needs to run worker_service's 'flashinfer'
# attention backend and FlashInfer kernels (worker_service/kernels/) without
# compiling anything:
#
#   flashinfer_py.tar.xz        FlashInfer's Python files (78 MB, 8 MB packed), unpacked
#                               by env.sh into $FI_SITE (/tmp/fi_site), whose
#                               flashinfer/data links back here; not the wheel's data/
#                               (CUTLASS/CCCL sources, kernels for other GPUs)
#   site/flashinfer/data/aot/   the kernel modules FlashInferAttention and FlashInferKernels
#                               load (attention; norm, rope, silu_and_mul, sampling),
#                               built here with nvcc for sm_90a; FlashInfer loads
#                               data/aot/<uri>/<uri>.so before trying to JIT-compile;
#                               radixserve_kernels.json lists them (the worker checks
#                               a model against it at start)
#   site/flashinfer/data/csrc/  the few templates FlashInfer reads to name a module
#   site/tvm_ffi/               apache-tvm-ffi for CPython 3.12 (FlashInfer >= 0.5 binds
#                               kernels through TVM-FFI, so modules link no torch)
#   extras/*.whl                test dependencies, installed there only when missing
#                               or too old (scripts/gpu_check.sh)
#   env.sh                      source it: PYTHONPATH, FLASHINFER_DISABLE_JIT=1, ...
#
# Usage: scripts/build_flashinfer_bundle.sh     (about 45 min on 2 idle cores for the
# default 28 attention modules: one job builds a prefill module in ~4 min, a decode
# module in ~1.2; reruns reuse the build cache in $FI_BUNDLE_WORK; docs/benchmarks.md
# estimates the bundle at ~61.5 MiB of the 64 a device run carries). Knobs: FI_HEAD_DIMS ("64 128 256"), FI_DTYPES ("bfloat16 float16"),
# FI_SOFTCAP_DTYPES ("bfloat16"), FI_SOFTCAP_HEAD_DIMS ("256"; "none": no soft-capped
# modules, 4.8 MiB less), FI_FP8KV_DTYPES (""; "bfloat16": the fp8-KV-cache modules, about
# 4.7 MiB a head dim, past the 64 MiB next to the default set), FI_FP8KV_HEAD_DIMS ("128"), FI_CUDA_ARCH, FI_PREFILL_BACKENDS ("fa2"; add fa3 for prefill_backend="auto"/"fa3" on
# Hopper, about 40 min per module on 2 cores), CUDA_HOME (nvcc 12.8+), FI_BUNDLE_PYTHON.
# The defaults are worker_service/attention/flashinfer_modules.py's.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${FI_BUNDLE_DIR:-$ROOT/.fi_bundle}
WORK=${FI_BUNDLE_WORK:-/tmp/fi_bundle_work}
PY=${FI_BUNDLE_PYTHON:-$ROOT/.venv/bin/python}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

# Pinned versions (FlashInfer's kernels and its TVM-FFI must match at run time).
FLASHINFER_PYTHON=0.7.2.post1
TVM_FFI=0.1.15.post2
CURAND=10.4.0.35 # headers only: CUTLASS's util headers include curand_kernel.h
BUILD_DEPS=(einops==0.8.2 nvidia-ml-py==13.615.71 tabulate==0.10.0 click==8.5.1)
# Test dependencies the GPU image may lack or have too old (the generated gRPC stubs
# need grpcio >= 1.85.1, protobuf >= 7.35.1); gpu_check.sh installs only those.
EXTRAS=(structlog==26.1.0 gguf==0.19.0 grpcio==1.85.3 grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1 protobuf==7.36.2)
PY312=(--python-version 3.12 --implementation cp --only-binary=:all:
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# Empty: flashinfer_modules.py's defaults (fp16 and bf16, head dims 64, 128, 256).
export FI_HEAD_DIMS=${FI_HEAD_DIMS:-}
export FI_DTYPES=${FI_DTYPES:-}
export FI_SOFTCAP_DTYPES=${FI_SOFTCAP_DTYPES:-}
export FI_SOFTCAP_HEAD_DIMS=${FI_SOFTCAP_HEAD_DIMS:-}
export FI_FP8KV_DTYPES=${FI_FP8KV_DTYPES:-}
export FI_FP8KV_HEAD_DIMS=${FI_FP8KV_HEAD_DIMS:-}
export FI_PREFILL_BACKENDS=${FI_PREFILL_BACKENDS:-"fa2"}
export FLASHINFER_CUDA_ARCH_LIST=${FI_CUDA_ARCH:-9.0a}

pip() { "$PY" -m pip "$@" --disable-pip-version-check -q; }

echo "== downloading pinned wheels into $WORK"
mkdir -p "$WORK"/{host,deps,w312,stubs}
pip download --no-deps -d "$WORK/host" "flashinfer-python==$FLASHINFER_PYTHON" \
  "apache-tvm-ffi==$TVM_FFI" "nvidia-curand==$CURAND"
pip download --no-deps -d "$WORK/deps" "${BUILD_DEPS[@]}"
pip download --no-deps "${PY312[@]}" -d "$WORK/w312" "apache-tvm-ffi==$TVM_FFI" "${EXTRAS[@]}"

echo "== build environment (this Python, FlashInfer's full sources)"
# Reinstalling would renew the headers' mtimes and make ninja rebuild every module.
if [[ ! -d $WORK/site/flashinfer_python-$FLASHINFER_PYTHON.dist-info ]]; then
  rm -rf "$WORK/site"
  pip install --no-deps --no-index --target "$WORK/site" "$WORK"/host/*.whl
fi
# Import-time needs of flashinfer that the GPU image already has, kept apart so the
# bundle check below cannot find FlashInfer files outside the bundle.
pip install --no-deps --no-index --upgrade --target "$WORK/deps_site" "$WORK"/deps/*.whl
# No libcuda on a GPU-less build machine: link against an empty stub with its
# soname (the modules end up not needing libcuda at all).
echo 'void fi_bundle_stub(void) {}' >"$WORK/stubs/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stubs/libcuda.so" "$WORK/stubs/stub.c"

export PYTHONPATH="$WORK/site:$WORK/deps_site"
export FLASHINFER_WORKSPACE_BASE="$WORK/ws"
export FLASHINFER_EXTRA_LDFLAGS="-L$WORK/stubs"
# norm.cu includes trtllm/common/cudaUtils.h, which includes cuBLAS's headers but uses
# nothing of them (its cuBLAS code is commented out). A toolkit without cuBLAS gets
# empty stand-ins: were anything of cuBLAS used, the build would fail, not the run.
mkdir -p "$WORK/stubs/include"
for h in cublasLt.h cublas_v2.h; do
  [[ -f $CUDA_HOME/include/$h ]] || echo "/* empty: see build_flashinfer_bundle.sh */" >"$WORK/stubs/include/$h"
done
export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $WORK/site/nvidia/cu13/include -isystem $WORK/stubs/include"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export FI_OUT="$OUT" FI_WORK="$WORK"

NEW="$WORK/bundle.new"
rm -rf "$NEW"
echo "== compiling modules for sm_${FLASHINFER_CUDA_ARCH_LIST/./} (dtypes: ${FI_DTYPES:-default}, heads: ${FI_HEAD_DIMS:-default})"
"$PY" "$ROOT/scripts/flashinfer_aot.py" "$NEW/site/flashinfer/data/aot"

echo "== assembling $OUT"
FI="$WORK/site/flashinfer"
# Every Python file, not just those imported here: on the GPU machine optional
# packages (triton, cuda-python) can make FlashInfer import more of itself.
(cd "$WORK/site" && find flashinfer -path flashinfer/data -prune -o -type f ! -name '*.pyc' \
  -print | LC_ALL=C sort >"$WORK/py_files.txt")
tar -C "$WORK/site" -c --owner=0 --group=0 --numeric-owner --mtime=@0 -T "$WORK/py_files.txt" |
  xz -T0 -6 >"$NEW/flashinfer_py.tar.xz"
mkdir -p "$NEW/site/flashinfer/data/csrc"
for f in batch_prefill_customize_config.jinja batch_prefill_paged_kernel_inst.jinja \
  batch_prefill_ragged_kernel_inst.jinja batch_prefill.cu batch_prefill_jit_binding.cu \
  batch_prefill_paged.cu batch_prefill_paged_jit_binding.cu batch_prefill_paged.cuh \
  batch_prefill_sm90_customize_config.jinja batch_prefill_paged_sm90_kernel_inst.jinja \
  batch_prefill_ragged_sm90_kernel_inst.jinja batch_prefill_sm90.cu \
  batch_prefill_sm90_jit_binding.cu batch_decode_customize_config.jinja \
  batch_decode_kernel_inst.jinja batch_decode.cu batch_decode_jit_binding.cu; do
  cp "$FI/data/csrc/$f" "$NEW/site/flashinfer/data/csrc/"
done
cp -r "$WORK/site/flashinfer_python-$FLASHINFER_PYTHON.dist-info" "$NEW/site/"
pip install --no-deps --no-index --no-compile "${PY312[@]}" --target "$NEW/site" \
  "$WORK"/w312/apache_tvm_ffi-*.whl
# Sources and headers serve compiling against TVM-FFI only, which the bundle never does.
rm -rf "$NEW"/site/tvm_ffi/{3rdparty,src,include,cython} "$NEW/site/bin"
mkdir -p "$NEW/extras"
for w in "$WORK"/w312/*.whl; do [[ $w == */apache_tvm_ffi-* ]] || cp "$w" "$NEW/extras/"; done
cat >"$NEW/env.sh" <<'EOF'
# Source me: use the bundle's FlashInfer and kernels; never JIT-compile.
FI_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Unpacked outside the bundle so the carried tree stays small; data/ (the kernels)
# is linked, FlashInfer finds it next to its __init__.py.
FI_SITE=${FI_SITE:-/tmp/fi_site}
stamp=$(cksum <"$FI_BUNDLE/flashinfer_py.tar.xz")
if [[ $(cat "$FI_SITE/.stamp" 2>/dev/null) != "$stamp" ]]; then
  if [[ -e $FI_SITE && ! -f $FI_SITE/.stamp ]]; then
    echo "FI_SITE=$FI_SITE exists and was not made by env.sh" >&2 && return 1
  fi
  rm -rf "$FI_SITE" && mkdir -p "$FI_SITE"
  tar -C "$FI_SITE" -xJf "$FI_BUNDLE/flashinfer_py.tar.xz"
  ln -s "$FI_BUNDLE/site/flashinfer/data" "$FI_SITE/flashinfer/data"
  echo "$stamp" >"$FI_SITE/.stamp"
fi
export PYTHONPATH="$FI_SITE:$FI_BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_DISABLE_JIT=1 # a missing kernel is an error, not a 40-minute build
# RMSNorm from the bundle's CUDA norm module: were nvidia-cutlass-dsl installed,
# FlashInfer would otherwise pick its CuTe DSL kernels, compiled at first use.
export FLASHINFER_USE_CUDA_NORM=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_workspace}
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 # torch >= 2.10 has the DLPack C API itself
EOF
{
  echo "flashinfer-python $FLASHINFER_PYTHON, apache-tvm-ffi $TVM_FFI (cp312), arch $FLASHINFER_CUDA_ARCH_LIST"
  echo "built with: $("$CUDA_HOME/bin/nvcc" --version | tail -1), $("$PY" -V)"
  (cd "$NEW/site/flashinfer/data/aot" && ls -d -- */ | tr -d /)
} >"$NEW/MANIFEST.txt"
rm -rf "$OUT" && mv "$NEW" "$OUT"
for part in "$OUT" "$OUT"/site/flashinfer/data/aot "$OUT"/site/tvm_ffi "$OUT"/extras \
  "$OUT"/flashinfer_py.tar.xz; do du -sh "$part"; done

echo "== checking the bundle with $("$PY" -V): this machine has neither 3.12 nor a GPU"
for so in "$OUT"/site/flashinfer/data/aot/*/*.so; do
  # Portable across torch builds: no torch/c10 symbols, and only libcudart (loaded by
  # torch on a CUDA build) beside the C/C++ runtime (rope's thread_local needs the
  # dynamic loader's __tls_get_addr: ld-linux).
  if readelf -d "$so" | grep NEEDED |
    grep -vqE 'libcudart\.so\.13|libstdc\+\+|libgcc_s|libc\.so|libm\.so|ld-linux-x86-64\.so\.2'; then
    echo "unexpected dependency in $so" && exit 1
  fi
  if nm -D --undefined-only "$so" | grep -qE ' _ZN(2at|3c10|5torch)'; then
    echo "torch symbols in $so" && exit 1
  fi
done
pip install --no-deps --no-index --upgrade --target "$WORK/tvm_host" "$WORK"/host/apache_tvm_ffi-*.whl
export FI_SITE="$WORK/fi_site" PYTHONDONTWRITEBYTECODE=1
# shellcheck source=/dev/null
source "$OUT/env.sh" # unpacks the Python files, as on the GPU machine
# This Python's tvm_ffi first (the bundle's is built for 3.12), then the bundle.
PYTHONPATH="$WORK/tvm_host:$FI_SITE:$OUT/site:$WORK/deps_site" FI_OUT="$FI_SITE" \
  FI_BUNDLE_REAL="$(realpath "$OUT")" FI_ROOT="$ROOT" \
  LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE="$WORK/check_ws" "$PY" - <<'EOF'
import os
import pathlib
import sys

import torch

import flashinfer
import flashinfer.activation
import flashinfer.norm
import flashinfer.rope
import flashinfer.sampling
from flashinfer.decode import get_batch_decode_module
from flashinfer.jit.attention import modules as m
from flashinfer.prefill import get_batch_prefill_module

sys.path.insert(0, os.environ["FI_ROOT"])
from worker_service.attention.flashinfer_modules import (
    OP_MODULES,
    flashinfer_kernel_source,
    needed_modules,
)

assert flashinfer.__file__.startswith(os.environ["FI_OUT"]), flashinfer.__file__
# The worker's view of the bundle: the manifest, read from FlashInfer's AOT dir.
source = flashinfer_kernel_source()
manifest = source.manifest
assert manifest is not None, f"no manifest in {source.aot_dirs[0]}"
n = 0
for module in manifest.attention:
    dt = getattr(torch, module.dtype)
    a = (dt, dt, dt, torch.int32, module.head_dim, module.head_dim, 0, module.sliding_window, False)
    # The lookups the wrappers' plan() makes; FLASHINFER_DISABLE_JIT=1 turns a
    # missing prebuilt module into an error instead of a build.
    if module.kind == "decode":
        spec = m.gen_batch_decode_module(*a)
    elif module.backend == "fa2":
        spec = m._gen_batch_prefill_primary_module("fa2", *a, False)
    else:
        continue  # fa3: loaded only by a prefill_backend the worker does not use
    assert spec.name == module.name, (spec.name, module.name)
    assert spec.is_aot, f"not prebuilt: {spec.name}"
    assert os.path.realpath(spec.aot_path).startswith(os.environ["FI_BUNDLE_REAL"])
    if module.kind == "decode":
        dec = get_batch_decode_module(*a)
        assert callable(dec.plan) and callable(dec.run)
    else:
        pre = get_batch_prefill_module("fa2", *a, False)
        assert callable(pre.plan) and callable(pre.paged_run)
    n += 1
# Everything the worker would ask for, for every group and window, is listed.
for dtype in {mod.dtype for mod in manifest.attention}:
    for hd in {mod.head_dim for mod in manifest.attention}:
        for group in (1, 4):
            for swa in (False, True):
                for need in needed_modules(dtype, hd, group=group, sliding_window=swa):
                    assert need in manifest.attention and source.has(need.name), need
assert tuple(manifest.ops) == OP_MODULES, manifest.ops
# FlashInferKernels' modules, through the getters its calls go through.
assert flashinfer.norm._USE_CUDA_NORM, "FLASHINFER_USE_CUDA_NORM=1 is not in effect"
ops = {
    "norm": (flashinfer.norm.get_norm_module(), ("rmsnorm", "fused_add_rmsnorm")),
    "rope": (flashinfer.rope.get_rope_module(), ("apply_rope_pos_ids_cos_sin_cache",)),
    "silu_and_mul": (flashinfer.activation.get_act_and_mul_module("silu"), ("silu_and_mul",)),
    "sampling": (
        flashinfer.sampling.get_sampling_module(),
        ("top_k_renorm_probs", "top_p_renorm_probs"),
    ),
}
for name, (module, functions) in ops.items():
    aot = os.path.join(os.environ["FI_BUNDLE_REAL"], "site/flashinfer/data/aot", name)
    assert os.path.isfile(os.path.join(aot, f"{name}.so")), f"not prebuilt: {name}"
    assert all(callable(getattr(module, f)) for f in functions), name
    n += 1
tvm = __import__("tvm_ffi")
# This check ran this Python's tvm_ffi; the bundle's (3.12) copy must hold every file
# of it that got imported (the build pruned sources and headers from it).
bundle_tvm = pathlib.Path(os.environ["FI_BUNDLE_REAL"], "site/tvm_ffi")
host_tvm = pathlib.Path(tvm.__file__).parent
for mod in list(sys.modules.values()):
    f = getattr(mod, "__file__", None) or ""
    if f.startswith(str(host_tvm)) and f.endswith(".py"):
        rel = pathlib.Path(f).relative_to(host_tvm)
        assert (bundle_tvm / rel).exists(), f"pruned but imported: tvm_ffi/{rel}"
assert list(bundle_tvm.glob("core.cpython-312-*.so")), "no CPython 3.12 tvm_ffi core"
print(f"bundle OK: flashinfer {flashinfer.__version__} from the bundle, {n} prebuilt "
      f"modules loaded through tvm_ffi {tvm.__version__}")
EOF
