"""SimulatedFiles: the simulated worker's file tier (the scheduler core's
tests). It keeps, per block hash, the slots of the host page written under
it (token ids and their adapters), as a worker's file store keeps the
page's bytes, and applies a plan's file copies as the worker must
(plan.py):

- ``storage_writes`` after the plan's write-backs: each host page's slots
  are copied aside at once (a block already stored is skipped);
- ``storage_reads`` are started with the plan and finished ``delay`` plans
  later (0: with its own result; drawn up to ``max_delay``). Their host
  pages read as garbage (-2) until then, so a load of one before the
  report puts wrong tokens where a request reads. A read fails (reported,
  its page left garbage) when the block is missing, or at random with
  ``fail_rate`` (a truncated or corrupt file); a failed page the scheduler
  used anyway puts garbage where a request reads.

The object outlives a worker (files survive the process): give it to the
worker that replaces a lost one; ``lose_worker`` drops the reads the dead
process had started. ``capacity`` blocks at most, oldest written first out
(the store's cap), so the scheduler's index is sometimes wrong.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from scheduler_service.core.ids import StorageCopies, StorageReadsDone, id_array

GARBAGE = -2


class HostPages(Protocol):
    page_size: int
    num_host_pages: int
    host_slots: list[int]
    host_slot_adapter: list[str | None]


@dataclass(slots=True)
class _Reads:
    left: int  # plans until the report
    step_id: int
    copies: StorageCopies


class SimulatedFiles:
    def __init__(
        self,
        *,
        fail_rate: float = 0.0,
        max_delay: int = 0,
        capacity: int = 1 << 30,
        seed: int = 0,
    ) -> None:
        self.fail_rate = fail_rate
        self.max_delay = max_delay
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.blocks: dict[int, tuple[list[int], list[str | None]]] = {}
        self._reads: list[_Reads] = []
        self.written = self.read_ok = self.read_failed = 0

    def write(self, host: HostPages, copies: StorageCopies) -> None:
        ps = host.page_size
        for h, page in zip(copies.hashes, copies.host, strict=True):
            if not 0 <= page < host.num_host_pages:
                raise AssertionError(f"a file write of host page {page}: outside the pool")
            if h in self.blocks:
                continue
            at = page * ps
            slots = host.host_slots[at : at + ps]
            if GARBAGE in slots:
                raise AssertionError(f"a file write of host page {page}, which a read is filling")
            self.blocks[h] = (slots, host.host_slot_adapter[at : at + ps])
            self.written += 1
            while len(self.blocks) > self.capacity:
                del self.blocks[next(iter(self.blocks))]

    def start_reads(self, host: HostPages, step_id: int, copies: StorageCopies) -> None:
        ps = host.page_size
        for page in copies.host:
            if not 0 <= page < host.num_host_pages:
                raise AssertionError(f"a file read into host page {page}: outside the pool")
            host.host_slots[page * ps : (page + 1) * ps] = [GARBAGE] * ps
        delay = self.rng.randint(0, self.max_delay) if self.max_delay else 0
        self._reads.append(_Reads(delay, step_id, copies))

    def finish(self, host: HostPages) -> list[StorageReadsDone] | None:
        """The reads due now, done: their reports (None: none)."""
        out: list[StorageReadsDone] = []
        keep: list[_Reads] = []
        ps = host.page_size
        for r in self._reads:
            if r.left > 0:
                r.left -= 1
                keep.append(r)
                continue
            failed = id_array()
            for i, (h, page) in enumerate(zip(r.copies.hashes, r.copies.host, strict=True)):
                block = self.blocks.get(h)
                if block is None or self.rng.random() < self.fail_rate:
                    failed.append(i)
                    self.read_failed += 1
                    continue
                at = page * ps
                host.host_slots[at : at + ps] = block[0]
                host.host_slot_adapter[at : at + ps] = block[1]
                self.read_ok += 1
            out.append(StorageReadsDone(r.step_id, failed))
        self._reads = keep
        return out or None

    @property
    def reads_out(self) -> int:
        return len(self._reads)

    def lose_worker(self) -> None:
        """The worker process died: the reads it had started die with it."""
        self._reads.clear()
