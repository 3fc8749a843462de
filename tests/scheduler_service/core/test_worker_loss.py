"""Scheduler.reset_after_worker_loss: the worker group is lost mid-run (its KV
and the plans in flight with it) and a fresh one, maybe of another size, takes
over. Every request must still produce the oracle's output, each token
delivered once, with the invariants checked after every step and update."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import pytest

from scheduler_service.core import (
    FinishLength,
    Place,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler_service.core.config import HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES
from scheduler_service.core.kv.events import AllBlocksCleared
from scheduler_service.testing.simulated_files import SimulatedFiles
from scheduler_service.testing.simulated_worker import SimulatedWorker
from tests.scheduler_service.core.support.sim_driver import (
    DriveLog,
    check_drained,
    check_outputs,
    make_pair,
)

V = 64

# (scheduler, step number) -> the new worker's page count, or None: no loss now
LossRule = Callable[[Scheduler, int], int | None]


def cfg(**kw) -> SchedulerConfig:
    kw.setdefault("vocab_size", V)
    return SchedulerConfig(**kw)


def req(rid: str, prompt, max_new: int = 8, **sp) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new, **sp))


def drive_with_losses(
    sched: Scheduler,
    worker: SimulatedWorker,
    reqs: list[Request],
    lose: LossRule,
    overlap: int = 1,
    max_steps: int = 20_000,
) -> tuple[DriveLog, int]:
    """Like sim_driver.drive, but ``lose`` may kill the worker after any step:
    the plans in flight are dropped unexecuted and a fresh worker takes over."""
    for r in reqs:
        sched.add_request(r)
    log = DriveLog()
    inflight: deque = deque()
    losses = 0

    def collect() -> None:
        for d in sched.drain():
            assert d.req.rid not in log.finished_deltas, f"{d.req.rid}: delta after finishing"
            log.deltas.setdefault(d.req.rid, []).extend(d.new_token_ids)
            if d.finished:
                log.finished_deltas[d.req.rid] = 1

    for t in range(max_steps):
        plan = sched.step()
        sched.check_integrity()
        if plan is not None:
            inflight.append(plan)
        while inflight and (len(inflight) > overlap or plan is None):
            sched.update(worker.execute(inflight.popleft()))
            sched.check_integrity()
        # The loss comes before the outbox is drained: tokens and finishes
        # already applied but not yet published must survive it.
        num_pages = lose(sched, t)
        if num_pages is not None:
            losses += 1
            inflight.clear()
            sched.reset_after_worker_loss(num_pages)
            sched.check_integrity()
            assert not sched.in_flight() and not sched.table.running and sched.table.chunked is None
            host = sched.config.hicache_host_pages  # a fresh host pool too
            files = worker.files  # the files survive; the reads the process started do not
            if files is not None:
                files.lose_worker()
            worker = SimulatedWorker(
                num_pages, sched.pool.page_size, V, num_host_pages=host, files=files
            )
            if files is not None:  # the new worker reports what its folder holds
                sched.note_stored_blocks(list(files.blocks))
        collect()
        if not inflight and sched.is_idle():
            break
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    check_drained(sched, worker)
    return log, losses


def at_steps(steps: dict[int, int]) -> LossRule:
    return lambda sched, t: steps.get(t)


@pytest.mark.parametrize("overlap", [0, 1, 2])
@pytest.mark.parametrize("new_pages", [64, 40, 96])
def test_outputs_survive_losses_at_any_overlap_and_pool_size(overlap, new_pages):
    reqs = [req(f"r{i}", range(i + 1, i + 14 + 3 * i), max_new=10 + 2 * i) for i in range(8)]
    config = cfg(page_size=4, max_running_requests=5, chunked_prefill_size=16)
    sched, worker = make_pair(config, 64, V)
    log, losses = drive_with_losses(
        sched, worker, reqs, at_steps({3: new_pages, 9: new_pages, 17: 64}), overlap
    )
    check_outputs(reqs, config, V, log)
    assert losses == 3 and sched.stats.worker_losses == 3
    assert sched.stats.finished == {"length": 8}
    assert sched.pool.num_pages == 64


def test_a_request_mid_chunked_prefill_is_requeued_and_prefilled_again():
    long = req("long", range(1, 60), max_new=6)
    short = req("short", range(60, 64), max_new=20)
    config = cfg(page_size=4, chunked_prefill_size=8)
    sched, worker = make_pair(config, 64, V)
    seen = []

    def lose(s: Scheduler, t: int) -> int | None:
        if not seen and s.table.chunked is long and long.kv_len >= 16:
            seen.append(long.kv_len)
            return 64
        return None

    log, losses = drive_with_losses(sched, worker, [long, short], lose, overlap=2)
    assert losses == 1 and seen
    check_outputs([long, short], config, V, log)
    assert long.retractions == 0  # a loss is not counted as a retraction


def test_finished_but_unpublished_and_in_flight_tokens_are_delivered_once():
    reqs = [req(f"r{i}", range(10 * i + 1, 10 * i + 9), max_new=3 + i) for i in range(6)]
    config = cfg(page_size=2)
    sched, worker = make_pair(config, 64, V)
    losses_at = []

    def lose(s: Scheduler, t: int) -> int | None:
        # right after an update finished someone, with others still running
        finished = [d for d in s._outbox if d.finished]
        if finished and s.table.running and len(losses_at) < 3:
            losses_at.append(t)
            return 64
        return None

    log, losses = drive_with_losses(sched, worker, reqs, lose, overlap=2)
    assert losses == 3
    check_outputs(reqs, config, V, log)


def test_siblings_sharing_a_prompt_all_complete():
    prompt = list(range(5, 30))
    reqs = [req(f"s-{i}", prompt, max_new=15) for i in range(4)]
    config = cfg(page_size=4)
    sched, worker = make_pair(config, 64, V)
    log, _ = drive_with_losses(sched, worker, reqs, at_steps({2: 64, 7: 64}), overlap=1)
    check_outputs(reqs, config, V, log)
    assert len({tuple(r.output_ids) for r in reqs}) == 1


def test_the_token_budget_and_stop_strings_count_the_tokens_already_generated():
    config = cfg(page_size=4)
    budget = req("budget", range(1, 9), max_new=12)
    stops = req("stops", range(20, 31), max_new=40, stop_strs=("<7>", "<13>"))
    sched, worker = make_pair(config, 64, V)
    log, _ = drive_with_losses(
        sched, worker, [budget, stops], at_steps({4: 64, 6: 64, 11: 64}), overlap=2
    )
    check_outputs([budget, stops], config, V, log)
    assert len(budget.output_ids) == 12 and budget.finish_reason == FinishLength(12)


def test_a_prefill_only_request_in_flight_is_not_lost():
    zero = req("zero", range(1, 12), max_new=0)
    other = req("other", range(40, 45), max_new=6)
    config = cfg(page_size=4)
    sched, worker = make_pair(config, 64, V)
    log, _ = drive_with_losses(sched, worker, [zero, other], at_steps({0: 64}), overlap=2)
    check_outputs([zero, other], config, V, log)


def test_reset_clears_the_cache_emits_the_event_and_keeps_the_output():
    config = cfg(page_size=4, enable_kv_events=True)
    sched, worker = make_pair(config, 32, V)
    r = req("r", range(1, 14), max_new=20)
    sched.add_request(r)
    for _ in range(5):
        sched.update(worker.execute(sched.step()))
    sched.drain()
    assert r.place is Place.RUNNING and sched.cache.cached_pages > 0
    before = list(r.output_ids)
    sched.cache.take_events()
    sched.step()  # one plan in flight, never answered
    requeued = sched.reset_after_worker_loss(16)
    sched.check_integrity()
    assert requeued == [r] and sched.table.waiting == [r] and r.place is Place.WAITING
    assert r.output_ids == before and not r.pages and r.kv_len == 0 and not r.on_worker
    assert sched.cache.cached_pages == 0 and sched.pool.num_free == sched.pool.num_pages == 16
    assert any(isinstance(e, AllBlocksCleared) for e in sched.cache.take_events())
    # Calling it again before anything ran (the new size only known later) is harmless.
    assert sched.reset_after_worker_loss(24) == []
    sched.check_integrity()
    assert sched.pool.num_pages == 24 and sched.table.waiting == [r]


def copies_in_flight(kinds: list[str]) -> LossRule:
    """Lose the worker (same size) while a plan in flight carries host-tier
    copies: first a load, then a write-back; ``kinds`` records each loss."""

    def lose(sched: Scheduler, t: int) -> int | None:
        want = ("loads", "write_backs")[len(kinds)] if len(kinds) < 2 else None
        if want and any(getattr(p, want) is not None for p in sched.in_flight()):
            kinds.append(want)
            return sched.pool.num_pages
        return None

    return lose


@pytest.mark.parametrize("policy", HICACHE_WRITE_POLICIES)
@pytest.mark.parametrize("overlap", [1, 2])
def test_losses_while_host_copies_are_in_flight(policy, overlap):
    """The host pool goes with the worker: every copy in flight is dropped,
    both tiers are emptied, and the requests still end with the oracle's
    output (the prefixes computed again, then copied and loaded again)."""
    # Three 8-page prefixes taken in turn (fcfs) through a 24-page device
    # pool: each is evicted to the host before it is used again.
    prefixes = [list(range(1 + 10 * k, 33 + 10 * k)) for k in range(3)]
    reqs = [req(f"r{i}", prefixes[i % 3] + [1 + i, 2 + i], max_new=3 + i % 4) for i in range(12)]
    config = cfg(
        page_size=4,
        max_running_requests=2,
        schedule_policy="fcfs",
        hicache_host_pages=96,
        hicache_write_policy=policy,
        hicache_load_back_threshold=1,
    )
    sched, worker = make_pair(config, 24, V)
    kinds: list[str] = []
    log, losses = drive_with_losses(sched, worker, reqs, copies_in_flight(kinds), overlap)
    check_outputs(reqs, config, V, log)
    assert kinds == ["loads", "write_backs"] and sched.stats.worker_losses == losses == 2
    tier = sched.hicache
    assert tier.transfers.loaded_pages > 0 and tier.transfers.written_pages > 0


def prefetches_out(count: list[int], most: int = 3) -> LossRule:
    """Lose the worker (same size) while file-tier reads are out, ``most`` times."""

    def lose(sched: Scheduler, t: int) -> int | None:
        tier = sched.hicache.storage
        if len(count) < most and tier.outstanding:
            count.append(t)
            return sched.pool.num_pages
        return None

    return lose


@pytest.mark.parametrize("policy", HICACHE_PREFETCH_POLICIES)
@pytest.mark.parametrize("overlap", [0, 1])
def test_losses_while_prefetches_are_out(policy, overlap):
    """The host pool and the reads go with the worker, the index too; the
    new worker's report fills the index again, and every request still ends
    with the oracle's output."""
    # Six 8-page prefixes in turn through 24 device and 32 host pages: the
    # host evicts them before they come again, the files keep them.
    prefixes = [[1 + (7 * k + j) % 60 for j in range(32)] for k in range(6)]
    reqs = [req(f"r{i}", prefixes[i % 6] + [1 + i, 2 + i], max_new=3 + i % 4) for i in range(18)]
    config = cfg(
        page_size=4,
        max_running_requests=2,
        schedule_policy="fcfs",
        hicache_host_pages=32,
        hicache_load_back_threshold=1,
        hicache_storage_pages=256,
        hicache_storage_prefetch_threshold=4,
        hicache_storage_prefetch_policy=policy,
    )
    files = SimulatedFiles(max_delay=3, fail_rate=0.1, seed=7)
    sched, worker = make_pair(config, 24, V, files=files)
    count: list[int] = []
    log, losses = drive_with_losses(sched, worker, reqs, prefetches_out(count), overlap)
    check_outputs(reqs, config, V, log)
    assert losses == len(count) >= 1
    assert sched.hicache.storage.stats.prefetches > losses
