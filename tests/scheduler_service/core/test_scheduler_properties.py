"""Property tests: random workloads through Scheduler + SimulatedWorker.

Each example draws a configuration (page size 1 or 16, tiny pools, chunking,
policies, priorities, mixed steps, overlap on or off) and a workload (shared
prefixes, arrival times, lengths, aborts, extra keys, prompt logprobs), runs it to the end with
``check_integrity()`` after every step and update, and checks every output
against the oracle and that the pool ends free or cached-unlocked.
"""

from __future__ import annotations

import os

from hypothesis import given, settings

from tests.scheduler_service.core.support.random_workloads import VOCAB, scenarios
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

EXAMPLES = int(os.environ.get("RADIXSERVE_PROPERTY_EXAMPLES", "120"))


def run_scenario(scenario, overlap: bool) -> None:
    config, num_pages, arrivals, aborts, aborted = scenario
    sched, worker = make_pair(config, num_pages, VOCAB)
    log = drive(sched, worker, arrivals, aborts, overlap=overlap)
    check_outputs([r for _, r in arrivals], config, VOCAB, log, allow_abort=aborted)
    check_drained(sched, worker)
    assert sched.stats.oom_aborts == 0


@settings(max_examples=EXAMPLES)
@given(scenarios())
def test_random_workloads_without_overlap(scenario):
    run_scenario(scenario, overlap=False)


@settings(max_examples=EXAMPLES)
@given(scenarios())
def test_random_workloads_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True))
def test_memory_pressure_without_overlap(scenario):
    run_scenario(scenario, overlap=False)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True))
def test_memory_pressure_with_overlap(scenario):
    run_scenario(scenario, overlap=True)
