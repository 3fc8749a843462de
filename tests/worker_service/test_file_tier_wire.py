"""The file tier on the wire: a scheduler with a file tier sends its plans'
storage writes and reads as packed columns (worker_codec.py), the worker
reads them back column for column (convert.py), its reports come back as
``StepResult.storage_done``, and validation refuses a plan with file copies
on a worker without a file tier, or with columns that do not fit, naming
the problem and applying nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.plan import ForwardMode as CoreMode
from scheduler_service.core.plan import StepPlan as CorePlan
from scheduler_service.engine.worker_codec import WorkerCodec
from scheduler_service.engine.worker_group import _stored_everywhere
from scheduler_service.testing.simulated_files import SimulatedFiles
from tests.scheduler_service.core.support.sim_driver import make_pair
from worker_service.execution.convert import plan_from_proto, result_to_proto
from worker_service.execution.plan import (
    ForwardMode,
    Plan,
    Result,
    StorageCopies,
    StorageReadsDone,
)
from worker_service.execution.validation import PlanError, validate_plan

V = 64
HOST_PAGES = 64
PREFIX = list(range(1, 41))


def _answer(result, plan) -> pb.StepResult:
    sampled = [e for e in plan.extends if e.sample] + plan.decodes
    by_rid = {o.rid: o.token_id for o in result.outputs}
    msg = pb.StepResult(step_id=plan.step_id, token_ids=[by_rid[e.rid] for e in sampled])
    for done in result.storage_done or ():
        msg.storage_done.add(step_id=done.step_id, failed=list(done.failed))
    return msg


def test_file_copies_and_reports_cross_the_wire():
    """A conversation computed, the cache flushed, the prefix again: the
    first pass writes files, the second reads them; every plan's columns
    arrive as sent and every report is decoded into the core's form."""
    config = SchedulerConfig(
        vocab_size=V,
        page_size=4,
        hicache_host_pages=HOST_PAGES,
        hicache_storage_pages=256,
        hicache_storage_prefetch_threshold=8,
        hicache_load_back_threshold=1,
    )
    sched, worker = make_pair(config, 32, V, files=SimulatedFiles())
    codec = WorkerCodec()
    writes = reads = reports = 0
    for turn, tail in enumerate(([50, 51], [52, 53])):
        sched.add_request(Request(f"r{turn}", PREFIX + tail, SamplingParams(max_new_tokens=4)))
        while not sched.is_idle():
            plan = sched.step()
            if plan is None:
                continue
            msg = pb.StepPlan.FromString(codec.encode(plan).SerializeToString())
            got = plan_from_proto(msg).storage
            sw, sr = plan.storage_writes, plan.storage_reads
            if sw is None and sr is None:
                assert got is None
            else:
                assert got is not None
                assert got.write_hashes.tolist() == (list(sw.hashes) if sw else [])
                assert got.write_host.tolist() == (list(sw.host) if sw else [])
                assert got.read_hashes.tolist() == (list(sr.hashes) if sr else [])
                assert got.read_host.tolist() == (list(sr.host) if sr else [])
                writes += got.num_writes
                reads += got.num_reads
            answer = pb.StepResult.FromString(
                _answer(worker.execute(plan), plan).SerializeToString()
            )
            result = codec.decode(answer, plan)
            reports += len(result.storage_done or ())
            sched.update(result)
            sched.check_integrity()
        if turn == 0:
            ok, _ = sched.flush_cache()
            assert ok
    assert writes >= len(PREFIX) // 4 and reads > 0 and reports > 0


def test_the_worker_reports_its_done_reads():
    r = Result(step_id=9, storage_done=[StorageReadsDone(3, [1, 4]), StorageReadsDone(5)])
    msg = pb.StepResult.FromString(result_to_proto(r).SerializeToString())
    plan = CorePlan(step_id=9, mode=CoreMode.IDLE)
    done = WorkerCodec().decode(msg, plan).storage_done
    assert [(d.step_id, list(d.failed)) for d in done] == [(3, [1, 4]), (5, [])]
    assert WorkerCodec().decode(pb.StepResult(step_id=9), plan).storage_done is None


def test_only_blocks_every_rank_holds_are_reported():
    infos = [
        pb.WorkerInfo(stored_block_hashes=[5, -7, 9, 2**62]),
        pb.WorkerInfo(stored_block_hashes=[9, 5, 2**62]),
    ]
    assert _stored_everywhere(infos) == [5, 9, 2**62]


def _storage(w_hash=(), w_host=(), r_hash=(), r_host=()) -> StorageCopies:
    def col(x):
        return np.array(x, dtype=np.int64)

    return StorageCopies(col(w_hash), col(w_host), col(r_hash), col(r_host))


def _validate(storage: StorageCopies, *, file_tier: bool = True, host_pages: int = 8) -> None:
    validate_plan(
        Plan(step_id=1, mode=ForwardMode.IDLE, storage=storage),
        {},
        num_pages=4,
        num_host_pages=host_pages,
        file_tier=file_tier,
        page_size=4,
        vocab_size=V,
        max_context=64,
    )


@pytest.mark.parametrize(
    ("storage", "file_tier", "host_pages", "error"),
    [
        (_storage([1], [2]), False, 8, "1 file writes and 0 file reads, but the worker has no"),
        (_storage(r_hash=[1], r_host=[2]), True, 0, "the worker has no file tier"),
        (_storage([1, 2], [3]), True, 8, "2 storage_write_hashes but 1 storage_write_host_pages"),
        (_storage(r_hash=[1], r_host=[]), True, 8, "1 storage_read_hashes but 0"),
        (_storage([1], [8]), True, 8, "storage_write_host_pages: page ids outside the pool"),
        (_storage(r_hash=[1], r_host=[-1]), True, 8, "storage_read_host_pages: page ids outside"),
        (_storage(r_hash=[1, 2], r_host=[3, 3]), True, 8, "host pages read twice: [3]"),
    ],
)
def test_bad_file_copies_are_refused_by_name(storage, file_tier, host_pages, error):
    with pytest.raises(PlanError, match=re.escape(error)):
        _validate(storage, file_tier=file_tier, host_pages=host_pages)


def test_good_file_copies_pass():
    _validate(_storage([-3, 2**62], [0, 0], [11], [1]))


def test_a_groups_reports_wait_for_every_rank_and_merge_their_failures():
    from scheduler_service.engine.storage_reports import StorageReports

    reports = StorageReports(2)

    def results(*per_rank):
        return [
            pb.StepResult(
                step_id=1, storage_done=[pb.StorageReadsDone(step_id=s, failed=f) for s, f in r]
            )
            for r in per_rank
        ]

    first = results([(3, [2]), (4, [])], [(4, [1])])
    reports.merge(first)
    assert [(d.step_id, list(d.failed)) for d in first[0].storage_done] == [(4, [1])]
    second = results([], [(3, [0])])
    reports.merge(second)
    assert [(d.step_id, list(d.failed)) for d in second[0].storage_done] == [(3, [0, 2])]
    reports.merge(third := results([(5, [])], []))
    reports.reset()
    assert not third[0].storage_done
    reports.merge(fourth := results([], [(5, [])]))
    assert not fourth[0].storage_done  # rank 0's report went with the old session
