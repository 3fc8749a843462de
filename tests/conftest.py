"""Test-wide settings.

Hypothesis runs a fixed, derandomized set of examples by default so CI is
reproducible; ``RADIXSERVE_HYPOTHESIS_PROFILE=explore`` draws fresh random
examples (and ``RADIXSERVE_PROPERTY_EXAMPLES`` sets how many the scheduler
property tests run).
"""

from __future__ import annotations

import os

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
