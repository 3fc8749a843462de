"""Property tests of speculative decoding: the random workloads of
test_scheduler_properties.py (page sizes, tiny pools with retraction,
chunking, policies, priorities, mixed steps, aborts, EOS / stop ids / stop
strings / min_new_tokens, overlap on and off) with a drafter that proposes
right, wrong and partly right drafts, check_integrity() after every step and
update, and every output equal to the oracle's; also with a sliding-window
model (rejected drafts move a request's end back: its sliding pages must
still cover the window from there)."""

from __future__ import annotations

import dataclasses
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import Scheduler
from tests.scheduler_service.core.support.random_workloads import VOCAB, scenarios
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    toy_stop_strings,
)
from tests.scheduler_service.core.support.spec_support import OracleDrafter, RecordingWorker

EXAMPLES = max(1, int(os.environ.get("RADIXSERVE_PROPERTY_EXAMPLES", "120")) // 2)


def run_with_drafts(scenario, overlap: bool | int, mode: str, seed: int) -> RecordingWorker:
    config, num_pages, arrivals, aborts, aborted, *sliding = scenario
    pools = sliding[0] if sliding else {}
    # No batch-size limit, or one of 2 or 4 running requests (drafting then
    # comes and goes as the batch changes).
    limit = (seed % 3) * 2
    config = dataclasses.replace(config, speculative_disable_by_batch_size=limit)
    drafter = OracleDrafter(VOCAB, mode, seed)
    sched = Scheduler(config, num_pages, stop_strings=toy_stop_strings, drafter=drafter, **pools)
    worker = RecordingWorker(
        num_pages,
        config.page_size,
        VOCAB,
        adapter_slots=config.max_loras_per_batch,
        drafter=drafter,
        **pools,
    )
    log = drive(sched, worker, arrivals, aborts, overlap=overlap)
    check_outputs([r for _, r in arrivals], config, VOCAB, log, allow_abort=aborted)
    check_drained(sched, worker)
    assert sched.stats.oom_aborts == 0
    stats = sched.stats
    # Results of aborted requests' drafted rows are discarded, not counted.
    same = (lambda x, y: x == y) if not aborted else (lambda x, y: x <= y)
    assert same(stats.spec_accepted_tokens, sum(a for _, a in worker.verified))
    assert same(stats.spec_draft_tokens, sum(k for k, _ in worker.verified))
    assert stats.spec_draft_tokens == sum(r.spec_draft_tokens for _, r in arrivals)
    return worker


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    scenarios(), st.sampled_from(["mixed", "right", "wrong"]), st.integers(0, 9), st.integers(1, 2)
)
def test_drafts_with_overlap(scenario, mode, seed, depth):
    run_with_drafts(scenario, depth, mode, seed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(scenarios(), st.sampled_from(["mixed", "right", "wrong"]), st.integers(0, 9))
def test_drafts_without_overlap(scenario, mode, seed):
    run_with_drafts(scenario, False, mode, seed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(scenarios(pressure=True), st.sampled_from(["mixed", "right"]), st.integers(0, 9))
def test_drafts_under_memory_pressure(scenario, mode, seed):
    run_with_drafts(scenario, True, mode, seed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(scenarios(sliding=True), st.sampled_from(["mixed", "right", "wrong"]), st.integers(0, 9))
def test_drafts_with_sliding_window(scenario, mode, seed):
    run_with_drafts(scenario, True, mode, seed)
