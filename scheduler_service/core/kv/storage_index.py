"""The blocks the scheduler believes are in the worker's file tier: a
bounded set of chained block hashes, least recently used first out.

Belief, not truth: the worker's store evicts files by its own cap and a
file may turn out bad, so every read is checked and reported
(kv/storage_tier.py); a failed read's hash leaves the index. What enters
it: each block the scheduler plans to write (a backup of a host copy), and
the hashes a worker reports at session open (``seed``: what its folder
already holds, e.g. after a process restart). Capacity: the file tier's
pages (``SchedulerConfig.hicache_storage_pages``), so the index forgets
about as the store evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class StorageIndex:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the storage index needs room for a block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, block_hash: int) -> list[int]:
        """Note ``block_hash`` as stored (most recent); the hashes forgotten
        to stay within capacity."""
        blocks = self._blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return []
        blocks[block_hash] = None
        out: list[int] = []
        while len(blocks) > self.capacity:
            out.append(blocks.popitem(last=False)[0])
        return out

    def touch(self, block_hash: int) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)

    def discard(self, block_hash: int) -> bool:
        return self._blocks.pop(block_hash, 0) is None

    def seed(self, hashes: Iterable[int]) -> list[int]:
        """Add every hash (a worker's report); the hashes forgotten."""
        out: list[int] = []
        for h in hashes:
            out += self.add(h)
        return out

    def clear(self) -> None:
        self._blocks.clear()
