"""Property tests of disaggregation: the random workloads of
test_scheduler_properties.py (configurations, shared prefixes, arrivals,
lengths, client aborts, prompt logprobs, memory pressure) served by a
prefill unit and a decode unit through a simulated transfer engine
(support/pd_driver.py), with or without overlap, and with faults: rooms
never claimed, transfers that fail or go silent (both sides time out), and
worker losses on either unit at any step. Integrity is checked on both
units after every step, update and engine event; every decode output is the
oracle's (a prefix of it for a request that failed), every prefill unit
answered its request's first token, and both units end with every page free
or cached and unlocked, no transfer record and no closing transfer left.
"""

from __future__ import annotations

import dataclasses
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler_service.core.support.pd_driver import FAULTS, RoomPlan, check_pd, drive_pd
from tests.scheduler_service.core.support.random_workloads import VOCAB, scenarios

EXAMPLES = int(os.environ.get("RADIXSERVE_PROPERTY_EXAMPLES", "120"))


@st.composite
def pd_scenarios(draw, faults: bool = False, pressure: bool = False):
    config, num_pages, arrivals, aborts, aborted = draw(scenarios(pressure=pressure))
    timeouts = (40.0, 25.0) if faults else (1e9, 1e9)
    config = dataclasses.replace(
        config,
        disaggregation_bootstrap_timeout_s=timeouts[0],
        disaggregation_waiting_timeout_s=timeouts[1],
    )
    pd_arrivals = []
    for tick, req in arrivals:
        if req.sampling.max_new_tokens == 0:  # a disaggregated request generates
            req.sampling = dataclasses.replace(req.sampling, max_new_tokens=1, min_new_tokens=0)
        fault = draw(st.sampled_from(FAULTS + (None,) * 6)) if faults else None
        plan = RoomPlan(fault, draw(st.integers(0, 3)), draw(st.integers(0, 3)))
        pd_arrivals.append((tick, req, plan))
    losses: dict[int, list[str]] = {}
    if faults:
        for _ in range(draw(st.integers(0, 2))):
            tick = draw(st.integers(0, 60))
            losses.setdefault(tick, []).append(draw(st.sampled_from(["prefill", "decode"])))
    allowed = {r.rid for _, r in arrivals} if faults else aborted
    return config, num_pages, pd_arrivals, aborts, losses, allowed


def run_pd(scenario, overlap: int) -> None:
    config, num_pages, arrivals, aborts, losses, allowed = scenario
    log = drive_pd(
        config, num_pages, VOCAB, arrivals, aborts=aborts, losses=losses, overlap=overlap
    )
    check_pd(log, VOCAB, allow_abort=allowed)
    for unit in (log.prefill, log.decode):
        assert unit.sched.stats.oom_aborts == 0


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios())
def test_disaggregated_workloads_without_overlap(scenario):
    run_pd(scenario, overlap=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios())
def test_disaggregated_workloads_with_overlap(scenario):
    run_pd(scenario, overlap=1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios(pressure=True))
def test_disaggregated_memory_pressure_with_overlap(scenario):
    run_pd(scenario, overlap=1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios(faults=True))
def test_disaggregated_faults_timeouts_and_worker_loss_without_overlap(scenario):
    run_pd(scenario, overlap=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios(faults=True))
def test_disaggregated_faults_timeouts_and_worker_loss_with_overlap(scenario):
    run_pd(scenario, overlap=1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pd_scenarios(faults=True, pressure=True))
def test_disaggregated_faults_under_memory_pressure(scenario):
    run_pd(scenario, overlap=1)
