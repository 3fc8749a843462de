"""Garbage collection settings for the service's long-running processes.

Every step makes a few thousand short-lived objects (deltas, outputs, plan
entries) that reference counting frees; with the default threshold (700
allocations) the collector still runs a young-generation pass several times
per step and, every hundred or so of those, a full pass over every object
the process holds (modules, protobuf descriptors, gRPC). Freezing what exists
after start-up takes those out of every pass; a larger young generation lets
most step objects die before a pass sees them. Cycles are still collected.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # allocations between young-generation passes (default 700)


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
