"""Property tests: random workloads through Scheduler + SimulatedWorker.

Each example draws a configuration (page size 1 or 16, tiny pools, chunking,
policies, priorities, mixed steps, overlap on or off) and a workload (shared
prefixes, arrival times, lengths, aborts, extra keys, prompt logprobs), runs it to the end with
``check_integrity()`` after every step and update, and checks every output
against the oracle and that the pool ends free or cached-unlocked; the sliding-window examples run
the same with a model shaped like Gemma 3 (a sliding pool, tiny windows),
the simulated worker checking every query's window; the host-tier examples
run them with a small device pool and a host pool (write-backs and loads
on the plans, the simulated worker copying the pages and checking what the
loads bring back); the file-tier examples add files behind the host pool
(backups, prefetches whose reads fail at random or come late, wait
policies with a ticking clock). The same workloads with the
results in the token column form (StepResult.tokens, the worker codec's
form for a plain step) must give the same deltas, outputs and finishes.
"""

from __future__ import annotations

import copy
import os

from hypothesis import given, settings

from tests.scheduler_service.core.support.random_workloads import VOCAB, Ticks, scenarios
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

EXAMPLES = int(os.environ.get("RADIXSERVE_PROPERTY_EXAMPLES", "120"))


def run_scenario(scenario, overlap: bool, *, columns: bool = False):
    config, num_pages, arrivals, aborts, aborted, *sliding = scenario
    # A clock that ticks per read, not the wall's: lpm's aging (and every
    # other time rule) then decides the same way however loaded the machine
    # is, so an example fails or passes on every run.
    kwargs = {"clock": Ticks(), **(sliding[0] if sliding else {})}
    sched, worker = make_pair(config, num_pages, VOCAB, **kwargs)
    log = drive(sched, worker, arrivals, aborts, overlap=overlap, columns=columns)
    check_outputs([r for _, r in arrivals], config, VOCAB, log, allow_abort=aborted)
    check_drained(sched, worker)
    assert sched.stats.oom_aborts == 0
    return log, sched.stats


def run_both_forms(scenario) -> None:
    """The scenario with results as outputs and as token columns: the same
    deltas, finishes, outputs and counts."""
    twin = copy.deepcopy(scenario)
    log, stats = run_scenario(scenario, overlap=True)
    col_log, col_stats = run_scenario(twin, overlap=True, columns=True)
    assert col_log.deltas == log.deltas
    assert col_log.finished_deltas == log.finished_deltas
    assert col_log.steps == log.steps
    assert col_stats == stats
    reasons = [(r.rid, r.finish_reason) for _, r in scenario[2]]
    assert [(r.rid, r.finish_reason) for _, r in twin[2]] == reasons


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


@settings(max_examples=EXAMPLES)
@given(scenarios())
def test_token_columns_decide_as_outputs_do(scenario):
    run_both_forms(scenario)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True))
def test_token_columns_decide_as_outputs_do_under_memory_pressure(scenario):
    run_both_forms(scenario)


@settings(max_examples=EXAMPLES)
@given(scenarios(sliding=True))
def test_sliding_window_workloads_without_overlap(scenario):
    run_scenario(scenario, overlap=False)


@settings(max_examples=EXAMPLES)
@given(scenarios(sliding=True))
def test_sliding_window_workloads_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True, sliding=True))
def test_sliding_window_memory_pressure_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(host_tier=True))
def test_host_tier_workloads_without_overlap(scenario):
    run_scenario(scenario, overlap=False)


@settings(max_examples=EXAMPLES)
@given(scenarios(host_tier=True))
def test_host_tier_workloads_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True, host_tier=True))
def test_host_tier_memory_pressure_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True, host_tier=True))
def test_host_tier_token_columns_decide_as_outputs_do(scenario):
    run_both_forms(scenario)


@settings(max_examples=EXAMPLES)
@given(scenarios(host_tier=True, storage=True))
def test_file_tier_workloads_with_overlap(scenario):
    run_scenario(scenario, overlap=True)


@settings(max_examples=EXAMPLES)
@given(scenarios(host_tier=True, storage=True))
def test_file_tier_workloads_without_overlap(scenario):
    run_scenario(scenario, overlap=False)


@settings(max_examples=EXAMPLES)
@given(scenarios(pressure=True, host_tier=True, storage=True))
def test_file_tier_memory_pressure_token_columns(scenario):
    run_both_forms(scenario)
