#!/usr/bin/env bash
# The GPU check, run from the repo root on a CUDA machine with no network that got
# the repo plus .fi_bundle (scripts/build_flashinfer_bundle.sh):
#
#   bash scripts/gpu_check.sh
#
# Points Python at the bundle (FlashInfer + prebuilt sm_90a kernels, JIT disabled;
# `make fi-bundle` builds it here), installs from the bundle only the test
# dependencies the machine lacks, prints the GPU, then, each step under its own
# timeout:
#   1. scripts/gpu_facts.py (at most 90 s, each fact 30 s; ~20-40 s expected): torch,
#      CUDA, FlashInfer versions, the bundle's kernel modules, bf16/fp16, our attention
#      per dtype x head dim x decode kernel against torch, CUDA-graph capture and
#      replay, NCCL (all_reduce, all_gather_into_tensor), pinned non-blocking copies,
#      set_sync_debug_mode;
#   2. `pytest -m gpu` (at most 150 s; test_fp8_gemm.py's share expected ~20-30 s, unmeasured);
#   3. scripts/gpu_decode_bench.py (at most 170 s: the Llama-3.1-8B shape in bf16,
#      random weights, batches 1/64/256, 1k context, flashinfer then torch, timed with
#      overlap; measured copy bandwidth, fraction of roofline, busy fraction).
# At most 410 s of steps plus ~30 s of setup (7.5 min; ~5 min expected), so a
# 15-minute device window holds the machine's start and a rerun of one step.
# Logs, gpu_facts.json and gpu_bench.json (both rewritten after each fact or
# configuration, so a timeout keeps what finished) go to $OUT when set (else
# /tmp/gpu_check). Exit status: the tests', else the benchmark's (a fact that fails
# is reported, not an exit status: it is what the run is for).
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
echo "== scripts/gpu_facts.py"
set +e
OUT=$LOGS timeout "${GPU_FACTS_TIMEOUT:-90}" "$PY" scripts/gpu_facts.py --fact-timeout-s 30 \
  2>&1 | tee "$LOGS/gpu_facts.log"
facts_rc=${PIPESTATUS[0]}
set -e

echo "== pytest -m gpu"
set +e
# The files that hold gpu-marked tests (a GPU image may lack what the others import).
GPU_TESTS=(tests/worker_service/test_flashinfer_backend.py tests/worker_service/test_gpu_worker.py
  tests/worker_service/test_fused_kernels_gpu.py tests/worker_service/test_fp8_gemm.py
  tests/worker_service/test_flashinfer_fp8_kv_gpu.py tests/worker_service/test_host_kv_cuda_gpu.py)
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
echo "== done in $((SECONDS - start)) s: facts exit $facts_rc, pytest exit $tests_rc," \
  "benchmark exit $bench_rc"
((tests_rc == 0)) || exit "$tests_rc"
exit "$bench_rc"
