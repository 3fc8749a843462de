"""One `radixserve serve` of the default model for all end-to-end tests."""

from __future__ import annotations

import pytest

from tests.e2e.system import serve


@pytest.fixture(scope="session")
def smollm2_address(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve"), "--log-level", "warning") as address:
        yield address
