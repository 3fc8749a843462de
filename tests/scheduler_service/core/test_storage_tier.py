"""The file tier behind the host tier (kv/storage_tier.py, kv/storage_ops.py):
backups keyed by the KV events' block hashes, the two-phase prefetch (reads
on a plan, reports later, only whole pages into the tree), the wait
policies, failed and missing files, a restarted worker's files, worker
loss mid-prefetch, and the tier off by default. Random workloads with
random read failures, delays and losses run in test_scheduler_properties.py
and test_worker_loss.py."""

from __future__ import annotations

import pytest

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.config import HICACHE_PREFETCH_POLICIES
from scheduler_service.core.kv.events import BlockRemoved, BlockStored, Medium, chain_page_hashes
from scheduler_service.core.kv.storage_ops import node_hashes
from scheduler_service.testing.simulated_files import SimulatedFiles
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

V = 64
PREFIX = list(range(1, 41))  # 10 pages of 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cfg(**kw) -> SchedulerConfig:
    base = dict(
        vocab_size=V,
        page_size=4,
        hicache_host_pages=64,
        hicache_storage_pages=256,
        hicache_storage_prefetch_threshold=8,
        hicache_load_back_threshold=1,
    )
    return SchedulerConfig(**{**base, **kw})


def req(rid: str, tail: list[int], prefix: list[int] = PREFIX, **kw) -> Request:
    return Request(rid, prefix + tail, SamplingParams(max_new_tokens=4), **kw)


def warm(config: SchedulerConfig, files: SimulatedFiles, **kw):
    """A scheduler whose files hold PREFIX (a request computed it) and whose
    tree holds nothing (flushed): what a restarted or evicted cache sees."""
    sched, worker = make_pair(config, 32, V, files=files, **kw)
    first = req("first", [50, 51])
    check_outputs([first], config, V, drive(sched, worker, [(0, first)]))
    ok, _ = sched.flush_cache()
    assert ok and sched.cache.num_nodes == 0
    return sched, worker


def run(sched, worker, reqs: list[Request], config: SchedulerConfig):
    log = drive(sched, worker, [(0, r) for r in reqs])
    check_outputs(reqs, config, V, log)
    check_drained(sched, worker)
    return log


def test_a_node_copied_to_the_host_is_backed_up_under_its_event_hashes():
    config = cfg(enable_kv_events=True)
    files = SimulatedFiles()
    sched, worker = make_pair(config, 32, V, files=files)
    plans = []
    r = req("a", [50, 51])
    sched.add_request(r)
    while not sched.is_idle():
        plan = sched.step()
        if plan is not None:
            plans.append(plan)
            sched.update(worker.execute(plan))
            sched.check_integrity()
    writes = [p for p in plans if p.storage_writes is not None]
    assert writes and all(p.write_backs is not None for p in writes)
    hashes = [h for p in writes for h in p.storage_writes.hashes]
    assert hashes[:10] == chain_page_hashes(0, PREFIX, 4)  # the events' hashes
    stored = {
        h for e in sched.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes
    }
    assert set(hashes) <= stored
    assert set(hashes) == set(files.blocks)
    # Copied again (evicted, computed again), it is not written twice.
    before = sched.hicache.storage.stats.written_pages
    sched.flush_cache()
    run(sched, worker, [req("b", [52, 53], prefix=PREFIX[:8])], config)
    assert sched.hicache.storage.stats.written_pages - before <= 2  # only its new tail


def test_hashes_without_events_are_the_events_hashes():
    sched, worker = make_pair(cfg(), 32, V, files=SimulatedFiles())
    run(sched, worker, [req("a", [50, 51])], cfg())
    node = sched.cache.match(PREFIX, touch=False).node
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    got = [h for n in reversed(path) for h in node_hashes(sched.cache, n)]
    assert got == chain_page_hashes(0, PREFIX, 4)


def test_a_prefix_in_the_files_is_prefetched_then_loaded():
    config = cfg()
    files = SimulatedFiles(max_delay=3, seed=1)
    sched, worker = warm(config, files)
    cached = sched.stats.cached_tokens
    r = req("r", [52, 53])
    run(sched, worker, [r], config)
    tier = sched.hicache.storage
    assert tier.stats.prefetches == 1 and tier.stats.read_pages == 10
    assert r.cached_tokens == 40 and sched.stats.cached_tokens - cached == 40
    assert sched.hicache.transfers.loaded_pages >= 10


def test_a_failed_read_frees_its_page_and_its_tokens_are_computed():
    config = cfg(enable_kv_events=True)
    files = SimulatedFiles(seed=3)
    sched, worker = warm(config, files)
    sched.take_kv_events()
    # Page 6 of the prefix turns out bad: pages 0-5 are used, 6-9 computed.
    bad = chain_page_hashes(0, PREFIX, 4)[6]
    del files.blocks[bad]
    r = req("r", [52, 53])
    run(sched, worker, [r], config)
    tier = sched.hicache.storage
    assert tier.stats.failed_reads == 1
    assert r.cached_tokens == 24
    # r computed pages 6-9 again; written through to the host, they were
    # backed up again: the file is whole once more.
    assert bad in tier.index and bad in files.blocks
    gone = [e for e in sched.take_kv_events() if isinstance(e, BlockRemoved)]
    assert any(e.medium is Medium.STORAGE and bad in e.block_hashes for e in gone)
    assert sched.hicache.host_pool.num_used == sum(
        len(n.host) for n in _nodes(sched.cache) if n.host is not None
    )


def test_every_read_failing_computes_everything_and_leaks_nothing():
    config = cfg()
    files = SimulatedFiles(fail_rate=1.0)
    sched, worker = warm(config, files)
    reqs = [req("r", [52, 53]), req("s", [54, 55])]
    run(sched, worker, reqs, config)
    assert sched.hicache.storage.stats.failed_reads > 0
    assert reqs[0].cached_tokens == 0


@pytest.mark.parametrize("policy", HICACHE_PREFETCH_POLICIES)
def test_the_wait_policies(policy):
    """A slow read (reported 50 plans later): best_effort does not wait,
    wait_complete waits for the report, timeout waits until its time is up;
    the prefetch fills the tree either way, for whoever comes next."""
    clock = Clock()
    config = cfg(
        hicache_storage_prefetch_policy=policy,
        hicache_storage_timeout_base_s=1.0,
        hicache_storage_timeout_per_ki_token_s=0.0,
    )
    files = SimulatedFiles()
    sched, worker = warm(config, files, clock=clock)
    files.max_delay = 50
    files.rng.randint = lambda a, b: 50  # type: ignore[method-assign]
    r = req("r", [52, 53])
    sched.add_request(r)
    waited = 0
    while not sched.is_idle():
        plan = sched.step()
        sched.check_integrity()
        if plan is not None:
            sched.update(worker.execute(plan))
            sched.check_integrity()
        if not r.finished and r.kv_len == 0:
            waited += 1
        clock.now += 0.1  # 10 polls a second
    assert r.finished
    if policy == "best_effort":
        assert waited == 0 and r.cached_tokens == 0
    elif policy == "wait_complete":
        assert waited >= 50 and r.cached_tokens == 40
    else:
        assert 9 <= waited <= 12 and r.cached_tokens == 0
        assert sched.hicache.storage.stats.timeouts == 1
    # The prefetch came in anyway: the prefix is on the host now.
    m = sched.cache.match(PREFIX + [60], touch=False)
    assert m.length + m.host_len == 40
    check_drained(sched, worker)


def test_a_restarted_worker_serves_what_its_files_hold():
    """A new scheduler (its worker process restarted on the same node) told
    what the folder holds serves the prefix from the files."""
    config = cfg()
    files = SimulatedFiles()
    warm(config, files)
    sched, worker = make_pair(config, 32, V, files=files)
    sched.note_stored_blocks(list(files.blocks))
    r = req("r", [52, 53])
    run(sched, worker, [r], config)
    assert r.cached_tokens == 40


def test_another_namespace_does_not_read_the_files():
    config = cfg()
    files = SimulatedFiles()
    sched, worker = warm(config, files)
    r = req("r", [52, 53], extra_key="salt")
    run(sched, worker, [r], config)
    assert sched.hicache.storage.stats.prefetches == 0 and r.cached_tokens == 0


def test_a_worker_loss_mid_prefetch_drops_the_reads_and_the_index():
    config = cfg()
    files = SimulatedFiles()
    sched, worker = warm(config, files)
    files.rng.randint = lambda a, b: 5  # type: ignore[method-assign]
    files.max_delay = 5
    r = req("r", [52, 53])
    sched.add_request(r)
    plan = sched.step()
    assert plan is not None and plan.storage_reads is not None
    sched.update(worker.execute(plan))
    assert sched.hicache.storage.outstanding
    files.lose_worker()
    sched.reset_after_worker_loss()
    sched.check_integrity()
    tier = sched.hicache.storage
    assert not tier.outstanding and len(tier.index) == 0 and not tier.by_rid
    assert sched.hicache.host_pool.num_used == 0
    worker = make_pair(config, 32, V, files=files)[1]
    sched.note_stored_blocks(list(files.blocks))  # the new worker's report
    files.max_delay = 0
    files.rng.randint = lambda a, b: 0  # type: ignore[method-assign]
    run(sched, worker, [], config)
    assert r.finished and r.output_ids


def test_the_tier_off_plans_no_file_copies():
    config = cfg(hicache_storage_pages=0)
    sched, worker = make_pair(config, 32, V)
    assert sched.hicache.storage is None and worker.files is None
    plans = []
    r = req("a", [50, 51])
    sched.add_request(r)
    while not sched.is_idle():
        plan = sched.step()
        if plan is not None:
            plans.append(plan)
            sched.update(worker.execute(plan))
    assert all(p.storage_writes is None and p.storage_reads is None for p in plans)
    with pytest.raises(ValueError, match="needs the host tier"):
        SchedulerConfig(hicache_storage_pages=8)


def _nodes(cache):
    out = []
    stack = list(cache.roots())
    while stack:
        n = stack.pop()
        stack += n.children.values()
        if n.parent is not None:
            out.append(n)
    return out
