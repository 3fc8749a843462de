"""Test-wide settings.

Tests that start a process running beside them carry the ``server`` marker
(every test under tests/e2e/ gets it here); `make test-fast` leaves them out,
and tests/support/process_guard.py fails an unmarked test that starts one.

Hypothesis runs a fixed, derandomized set of examples by default so CI is
reproducible; ``RADIXSERVE_HYPOTHESIS_PROFILE=explore`` draws fresh random
examples (and ``RADIXSERVE_PROPERTY_EXAMPLES`` sets how many the scheduler
property tests run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import process_guard

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the GPU machine runs only the gpu tests and may lack it
    settings = None

if settings is not None:
    for name, extra in (("ci", {"derandomize": True}), ("explore", {})):
        settings.register_profile(
            name,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            **extra,
        )
    settings.load_profile(os.environ.get("RADIXSERVE_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    process_guard.install()
    config.pluginmanager.register(
        process_guard.ProcessGuardPlugin(Path(__file__).parent), "radixserve-process-guard"
    )
