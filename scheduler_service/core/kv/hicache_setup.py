"""The tiered cache a SchedulerConfig asks for: None without a host tier
(``hicache_host_pages`` 0), else a HiRadixCache over the device pool and a
host pool of its own, with the file tier behind it when
``hicache_storage_pages`` is set."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv.hiradix_cache import HiRadixCache
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.storage_tier import StorageTier


def build_hicache(
    config: SchedulerConfig, pool: PagePool, *, sliding: bool, clock: Callable[[], float]
) -> HiRadixCache | None:
    """``sliding``: the model has a sliding pool (refused with a host tier);
    ``clock``: the scheduler's, which times prefetches."""
    if config.hicache_host_pages <= 0:
        return None
    if sliding:
        raise ValueError("the host tier does not serve sliding-window models yet")
    storage = None
    if config.hicache_storage_pages > 0:
        storage = StorageTier(
            config.hicache_storage_pages,
            config.page_size,
            threshold=config.hicache_storage_prefetch_threshold,
            policy=config.hicache_storage_prefetch_policy,
            timeout_base_s=config.hicache_storage_timeout_base_s,
            timeout_per_ki_token_s=config.hicache_storage_timeout_per_ki_token_s,
            timeout_max_s=config.hicache_storage_timeout_max_s,
            clock=clock,
        )
    return HiRadixCache(
        config.page_size,
        pool,
        PagePool(config.hicache_host_pages, config.page_size),
        hits_to_write=config.hicache_hits_to_write,
        load_back_threshold=config.hicache_load_back_threshold,
        enable_events=config.enable_kv_events,
        storage=storage,
    )
