"""The file tier's columns of a plan (protos/worker.proto, StepPlan): what
makes a plan with file copies refused before any of it is applied."""

from __future__ import annotations

import numpy as np

from worker_service.execution.plan import StorageCopies


def storage_problem(storage: StorageCopies, *, file_tier: bool, num_host_pages: int) -> str | None:
    """Why ``storage`` cannot run here, or None: a file tier (and the host
    pool it copies through), parallel columns, host pages inside the pool,
    and no host page read twice (which read would win is undefined)."""
    if not file_tier or not num_host_pages:
        return (
            f"{storage.num_writes} file writes and {storage.num_reads} file reads, "
            "but the worker has no file tier (--hicache-file-dir)"
        )
    pairs = (
        (
            "storage_write_hashes",
            storage.write_hashes,
            "storage_write_host_pages",
            storage.write_host,
        ),
        ("storage_read_hashes", storage.read_hashes, "storage_read_host_pages", storage.read_host),
    )
    for name_a, a, name_b, b in pairs:
        if len(a) != len(b):
            return f"{len(a)} {name_a} but {len(b)} {name_b} (parallel columns)"
        if len(b) and (int(b.min()) < 0 or int(b.max()) >= num_host_pages):
            bad = b[(b < 0) | (b >= num_host_pages)][:5].tolist()
            return f"{name_b}: page ids outside the pool [0, {num_host_pages}): {bad}"
    read = storage.read_host
    if len(np.unique(read)) != len(read):
        values, counts = np.unique(read, return_counts=True)
        return f"storage_read_host_pages: host pages read twice: {values[counts > 1][:5].tolist()}"
    return None
