"""Fixtures the worker's test files share."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.worker_service.support.flashinfer_reference import Placement


@pytest.fixture
def flashinfer_ok() -> None:
    if importlib.util.find_spec("flashinfer") is None:
        if os.environ.get("RADIXSERVE_REQUIRE_FLASHINFER") == "1":
            pytest.fail("flashinfer is not importable (is .fi_bundle/env.sh sourced?)")
        pytest.skip("flashinfer is not installed")


@pytest.fixture
def fi_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Placement]:
    """FlashInfer's real wrappers on the CPU (flashinfer_cpu_harness.py)."""
    # Imported here, not above: every test under this folder loads this file,
    # the GPU image among them, and only the conformance tests need the harness.
    import torch

    from tests.worker_service.support import flashinfer_cpu_harness as harness

    # Every tensor here is tiny: intra-op threads cost more than they save, and on
    # a busy 2-core machine their spin-waits made each op ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield harness.install(monkeypatch)
    finally:
        harness.clear_module_caches()
        torch.set_num_threads(threads)
