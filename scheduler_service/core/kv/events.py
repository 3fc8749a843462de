"""Events the radix cache emits when pages enter or leave it.

They are what the public API serves as ``SubscribeKvEvents`` so a
cache-aware router (the SMG gateway) can mirror which prefixes this replica
holds. A page ("block") is named by a 64-bit hash chained from the root: the
hash of page i covers its own tokens and the hash of page i - 1, seeded by the
cache namespace (``extra_key``), so equal hashes mean equal prefixes.

With the host tier (kv/hiradix_cache.py) every stored and removed event
names its ``medium``, as SGLang's do: a prefix whose device pages are
evicted while a host copy stays is removed from the device and (when the
copy is made) stored on the host; a load back stores it on the device again.
The values are SGLang's wire strings, so a router reading either sees the
same tiers.
"""

from __future__ import annotations

import enum
import hashlib
from collections import deque
from dataclasses import dataclass


class Medium(str, enum.Enum):
    """Where a block's KV lives (SGLang's StorageMedium values)."""

    DEVICE = "GPU"  # the worker's KV pool (named GPU by SGLang whatever the device)
    HOST = "CPU_PINNED"  # the worker's host pool (the host tier)
    STORAGE = "DISK"  # the file tier behind the host tier (kv/storage_tier.py)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    extra_key: str | None
    medium: Medium = Medium.DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: Medium = Medium.DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def namespace_seed(extra_key: str | None) -> int:
    """Stable across processes (str hashes are salted per process, so not hash())."""
    if extra_key is None:
        return 0
    digest = hashlib.blake2b(extra_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def chain_page_hashes(parent_hash: int, tokens: list[int], page_size: int) -> list[int]:
    """Hash of each page of ``tokens``, chained from ``parent_hash``.

    Tuples of ints hash the same in every process (only str and bytes are
    salted), which keeps this fast enough to run on every insert.
    """
    out: list[int] = []
    h = parent_hash
    if page_size == 1:
        for t in tokens:
            h = hash((h, t))
            out.append(h)
    else:
        for i in range(0, len(tokens), page_size):
            h = hash((h, *tokens[i : i + page_size]))
            out.append(h)
    return out


class EventLog:
    """Bounded buffer of events; the consumer drains it with ``take``.

    If nobody drains it, the oldest events are dropped and counted, so an
    absent subscriber cannot grow the scheduler's memory.
    """

    def __init__(self, max_events: int = 65536) -> None:
        self._events: deque[KvEvent] = deque(maxlen=max_events)
        self.dropped = 0

    def append(self, event: KvEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)

    def take(self) -> list[KvEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
