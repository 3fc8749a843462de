"""Opening the file tier (--hicache-file-dir) behind a host KV pool: the
store's folder for this rank's layout, its cap in bytes and in pages."""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog

from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_file_store import HEADER_SIZE, KvFileStore, KvLayout
from worker_service.execution.file_copies import HostKvFiles

logger = structlog.get_logger(__name__)

GIB = 1 << 30
FREE_SPACE_SHARE = 0.9  # without --hicache-file-size: this much of the free space at start


def open_file_tier(root: str, size_gib: float, host: HostKvPool, layout: KvLayout) -> HostKvFiles:
    """The file tier under ``root`` capped at ``size_gib`` GiB (0: 90% of the
    filesystem's free space now); SystemExit naming the fix when it cannot
    hold one page."""
    Path(root).mkdir(parents=True, exist_ok=True)
    page_nbytes = host.bytes_per_page
    if size_gib > 0:
        max_bytes = int(size_gib * GIB)
    else:
        max_bytes = int(shutil.disk_usage(root).free * FREE_SPACE_SHARE)
    if max_bytes < HEADER_SIZE + page_nbytes:
        raise SystemExit(
            f"--hicache-file-dir {root}: {max_bytes} bytes cannot hold one {page_nbytes}-byte "
            "page (raise --hicache-file-size, or free space there)"
        )
    store = KvFileStore(root, layout, page_nbytes, max_bytes)
    files = HostKvFiles(host, store)
    logger.info(
        "file KV tier",
        folder=str(store.dir),
        pages=num_storage_pages(files),
        gib=round(max_bytes / GIB, 3),
        stored=len(store.stored_hashes()),
    )
    return files


def num_storage_pages(files: HostKvFiles) -> int:
    """The pages the store's cap holds (WorkerInfo.num_storage_pages)."""
    store = files.store
    return store.max_bytes // (HEADER_SIZE + store.page_nbytes)
