"""RestartBackoff: 1 s, doubling to 30 s while what restarts keeps dying
young; from 1 s again after it stayed up 60 s."""

from __future__ import annotations

from common.restart_backoff import RestartBackoff


def test_waits_double_up_to_the_cap_and_start_over_after_a_stable_run():
    b = RestartBackoff()
    assert [b.delay(up_for_s=2.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.delay(up_for_s=60.0) == 1  # it had been healthy
    assert b.delay(up_for_s=0.0) == 2  # an attempt that never came up
