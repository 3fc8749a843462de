"""The host tier's flags (SGLang's names): the worker's switch and sizes, the
scheduler's write policy, what `radixserve serve` passes on, and the
combinations refused at start with the fix named."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.config import load_config as scheduler_config
from scheduler_service.core import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.serve import _worker_args
from tests.worker_service.support.worker_process import worker_process
from worker_service.config import WorkerConfig, check_hicache_flags
from worker_service.config import load_config as worker_config

SCHEDULER = ["--worker", "grpc://127.0.0.1:1"]


def test_off_by_default_and_sglang_defaults_when_on():
    cfg = worker_config([], env={})
    assert not cfg.enable_hierarchical_cache
    on = worker_config(["--enable-hierarchical-cache"], env={})
    assert (on.enable_hierarchical_cache, on.hicache_ratio, on.hicache_size) == (True, 2.0, 0.0)
    sized = worker_config(
        ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "1.5"], env={}
    )
    assert (sized.hicache_ratio, sized.hicache_size) == (3.0, 1.5)
    from_env = worker_config([], env={"RADIXSERVE_WORKER_ENABLE_HIERARCHICAL_CACHE": "1"})
    assert from_env.enable_hierarchical_cache


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--hicache-ratio", "4"], "--hicache-ratio 4 size the host KV tier; add --enable-hier"),
        (["--hicache-size", "8"], "--hicache-size 8 size the host KV tier; add --enable-hier"),
        (["--enable-hierarchical-cache", "--hicache-ratio", "0"], "--hicache-ratio must be > 0"),
        (["--enable-hierarchical-cache", "--hicache-size", "-1"], "--hicache-size must be >= 0"),
        (["--enable-hierarchical-cache", "--model", "simulated"], "the simulated model keeps none"),
    ],
)
def test_combinations_that_cannot_work_are_refused_at_start(argv, error):
    with pytest.raises(SystemExit, match=error):
        worker_config(argv, env={})


def test_the_scheduler_takes_sglangs_write_policies():
    assert scheduler_config(SCHEDULER).scheduler.hicache_write_policy == "write_through"
    for policy in ("write_through", "write_through_selective", "write_back"):
        cfg = scheduler_config([*SCHEDULER, "--hicache-write-policy", policy])
        assert cfg.scheduler.hicache_write_policy == policy
        assert cfg.scheduler.hicache_host_pages == 0  # the workers' report sets it
    with pytest.raises(SystemExit):
        scheduler_config([*SCHEDULER, "--hicache-write-policy", "write_around"])


def test_serve_passes_the_tier_on_to_its_workers():
    service = scheduler_config(SCHEDULER)
    worker = WorkerConfig(enable_hierarchical_cache=True, hicache_ratio=3.0, hicache_size=0.5)
    check_hicache_flags(worker)
    args = _worker_args(worker, service, 0, Path("/tmp/port"), dist="", port=1)
    at = args.index("--enable-hierarchical-cache")
    assert args[at + 1 : at + 5] == ["--hicache-ratio", "3.0", "--hicache-size", "0.5"]
    plain = _worker_args(WorkerConfig(), service, 0, Path("/tmp/port"), dist="", port=1)
    assert "--enable-hierarchical-cache" not in plain


@pytest.mark.server
def test_a_worker_reports_its_host_pool_and_the_scheduler_sizes_its_tier_by_it(tmp_path):
    """GetInfo over gRPC carries num_host_pages; the core builds its host tier
    of that many pages (engine/main.py's rule)."""
    args = ("--model", "default", "--num-pages", "8", "--enable-hierarchical-cache")
    with (
        worker_process(tmp_path, *args, "--hicache-ratio", "2.5") as address,
        grpc.insecure_channel(address) as channel,
    ):
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
    assert (info.num_pages, info.num_host_pages) == (8, 20)
    cfg = SchedulerConfig(page_size=info.page_size, hicache_host_pages=info.num_host_pages)
    sched = Scheduler(cfg, info.num_pages)
    assert sched.hicache is not None and sched.hicache.host_pool.num_pages == 20
