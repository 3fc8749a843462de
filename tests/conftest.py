"""Test-wide settings.

Hypothesis runs a fixed, derandomized set of examples by default so CI is
reproducible; ``RADIXSERVE_HYPOTHESIS_PROFILE=explore`` draws fresh random
examples (and ``RADIXSERVE_PROPERTY_EXAMPLES`` sets how many the scheduler
property tests run).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("RADIXSERVE_HYPOTHESIS_PROFILE", "ci"))
