"""The default model's worker with a host KV tier, in-process, for the host
tier's worker tests: its runner, its device KV cache and its host pool."""

from __future__ import annotations

from tests.worker_service.support.worker_factory import worker_for
from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_cache import KvCache
from worker_service.execution.model_runner import ModelRunner


def tiny_runner(
    *, num_pages: int, host_pages: int, **overrides
) -> tuple[ModelRunner, KvCache, HostKvPool]:
    """``num_pages`` device pages and ``host_pages`` host pages (sized through
    --hicache-ratio, as a user would)."""
    worker = worker_for(
        "default",
        num_pages=num_pages,
        enable_hierarchical_cache=True,
        hicache_ratio=host_pages / num_pages,
        swa_memory=False,
        **overrides,
    )
    compute = worker.runner.compute
    host = compute.host_kv  # type: ignore[attr-defined]
    assert host is not None and host.num_pages == host_pages == worker.num_host_pages
    return worker.runner, compute.kv, host  # type: ignore[attr-defined]
