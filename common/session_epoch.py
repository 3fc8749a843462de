"""The range of a worker session's epoch, shared by the worker (which refuses
an opening outside it) and the scheduler (which refuses a worker that reports
an epoch it cannot open above).

The wire type is uint64, but the protocol stops at 2**63 - 1: readers that
hold an epoch signed (Java, Go's int64, SQL) stay correct, and a scheduler's
"highest reported + 1" always fits the field. A scheduler's epoch is its
clock in ns (about 2**60.6 in 2025), so the range leaves centuries of room.
"""

from __future__ import annotations

MAX_SESSION_EPOCH = (1 << 63) - 1
MAX_SESSION_EPOCH_TEXT = f"{MAX_SESSION_EPOCH} (2**63 - 1)"
