"""Graceful drain in the chart: the scheduler's preStop sleep, drain timeout
and terminationGracePeriodSeconds follow scheduler.drainTimeoutSeconds and
scheduler.preStopSleepSeconds; its workers outlive its drain; the liveness
probe asks the "liveness" service, readiness the overall one."""

from __future__ import annotations

import pytest

from tests.helm.support.chart import (
    VALUE_SETS,
    component,
    config_env,
    container,
    render,
    render_error,
)


def _pods(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and component(d) == kind]


def _check(docs: list[dict], pre_stop: int, drain: int) -> None:
    env = config_env(docs)
    assert env["RADIXSERVE_DRAIN_TIMEOUT"] == str(drain)
    worker_drain = int(env["RADIXSERVE_WORKER_DRAIN_TIMEOUT"])
    assert worker_drain > pre_stop + drain  # a worker serves its scheduler's whole drain
    schedulers, workers = _pods(docs, "scheduler"), _pods(docs, "worker")
    assert schedulers and workers
    for d in schedulers:
        spec = d["spec"]["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + drain + 10, grace  # room to exit after the drain
        c = container(d)
        if pre_stop:
            assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
        else:
            assert "lifecycle" not in c
        assert c["livenessProbe"]["grpc"]["service"] == "liveness"
        assert "service" not in c["readinessProbe"]["grpc"]  # "": readiness
    for d in workers:
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= worker_drain + 10, grace


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_default_drain_in_every_value_set(value_set):
    _check(render(value_set), pre_stop=5, drain=60)


def test_a_longer_drain_and_no_pre_stop_follow_the_values():
    docs = render(
        None, {"scheduler.drainTimeoutSeconds": "600", "scheduler.preStopSleepSeconds": "0"}
    )
    _check(docs, pre_stop=0, drain=600)
    (scheduler,) = _pods(docs, "scheduler")
    assert scheduler["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 615


def test_the_schema_refuses_a_negative_drain():
    message = render_error({"scheduler.drainTimeoutSeconds": "-1"})
    assert "drainTimeoutSeconds" in message and "minimum" in message
