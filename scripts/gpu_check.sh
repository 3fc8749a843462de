#!/usr/bin/env bash
# The GPU check, run from the repo root on a CUDA machine with no network that got
# the repo plus .fi_bundle (scripts/build_flashinfer_bundle.sh):
#
#   bash scripts/gpu_check.sh
#
# Points Python at the bundle (FlashInfer + prebuilt sm_90a kernels, JIT disabled;
# `make fi-bundle` builds it here), installs from the bundle only the test
# dependencies the machine lacks, prints the GPU, runs `pytest -m gpu` (at most
# 150 s), then scripts/gpu_decode_bench.py (at most 170 s: the Llama-3.1-8B shape in
# bf16, random weights, batches 1/64/256, 1k context, flashinfer then torch, measured
# copy bandwidth, fraction of roofline, busy fraction). At most 6 minutes in all.
# Logs and gpu_bench.json go to $OUT when set (else /tmp/gpu_check). Exit status: the
# tests', else the benchmark's.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
exec > >(tee "$LOGS/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
start=$SECONDS

if [[ ! -f .fi_bundle/env.sh ]]; then
  echo "no .fi_bundle/: build it with scripts/build_flashinfer_bundle.sh and carry it" >&2
  exit 2
fi
# shellcheck source=/dev/null
source .fi_bundle/env.sh
export RADIXSERVE_REQUIRE_FLASHINFER=1 # a missing flashinfer fails the tests, not skips

# Bundled wheels for what the image lacks or has too old (e.g. structlog, gguf).
missing=$("$PY" - <<'EOF'
import importlib.metadata as md
import pathlib
import re


def key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


for wheel in sorted(pathlib.Path(".fi_bundle/extras").glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        if key(md.version(name)) >= key(version):
            continue
    except md.PackageNotFoundError:
        pass
    print(wheel)
EOF
)
if [[ -n $missing ]]; then
  echo "== installing from the bundle: $(echo "$missing" | xargs -n1 basename | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi_extras $missing
  export PYTHONPATH="/tmp/fi_extras:$PYTHONPATH"
fi

echo "== GPU"
nvidia-smi
"$PY" - <<'EOF'
import sys

import torch
import tvm_ffi

import flashinfer

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),",
      f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
print(f"flashinfer {flashinfer.__version__} from {flashinfer.__file__}, tvm_ffi {tvm_ffi.__version__}")
EOF

echo "== pytest -m gpu"
set +e
# The files that hold gpu-marked tests (a GPU image may lack what the others import).
GPU_TESTS=(tests/worker_service/test_flashinfer_backend.py tests/worker_service/test_gpu_worker.py
  tests/worker_service/test_fused_kernels_gpu.py)
timeout "${GPU_TESTS_TIMEOUT:-150}" "$PY" -m pytest -m gpu -q -p no:cacheprovider "${GPU_TESTS[@]}" \
  --junitxml="$LOGS/pytest_gpu.xml" 2>&1 | tee "$LOGS/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}
echo "== scripts/gpu_decode_bench.py"
# Random weights made on the GPU (the GGUF is not carried: 64 MiB limit), KV filled
# with random values instead of a prefill. --budget-s skips the configurations not
# started by then (flashinfer ones come first), so the timeout is a last resort.
OUT=$LOGS timeout "${GPU_BENCH_TIMEOUT:-170}" "$PY" scripts/gpu_decode_bench.py \
  --models random:llama-3.1-8b --backends flashinfer,torch \
  --batches 1,64,256 --context 1024 --steps 20 --max-config-s 15 --budget-s 140 \
  2>&1 | tee "$LOGS/gpu_decode_bench.log"
bench_rc=${PIPESTATUS[0]}
set -e
echo "== done in $((SECONDS - start)) s: pytest exit $tests_rc, benchmark exit $bench_rc"
((tests_rc == 0)) || exit "$tests_rc"
exit "$bench_rc"
