# `make test` sets up a fresh machine (a virtualenv in .venv) and runs the
# linters and the test suite. It is what CI runs (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test lint bench-core clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

bench-core: setup
	$(BIN)/python benchmarks/scheduler_core.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
