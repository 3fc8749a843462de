"""The file tier's bookkeeping (SGLang's HiCache storage, scheduler side):
which blocks are believed on disk, the writes and reads the plan being
built will carry, and the prefetches the worker has not reported.

A third medium behind device and host, but not a node state: files
outlive the tree's nodes (a host-evicted node's blocks stay on disk), so
storage is an index of chained block hashes (kv/storage_index.py) that a
match continues into past its device and host parts. The tree operations
(backup, starting and finishing a prefetch) are in kv/storage_ops.py.

- *Backup*: a node copied to the host is written to the files on the same
  plan (``storage_writes``, after the write-backs), page by page, for
  blocks the index does not hold; the index holds them at once.
- *Prefetch, two phases*: (a) a waiting request whose match continues in
  the index by at least ``threshold`` tokens gets host pages for those
  blocks, and the plan being built carries their reads (``Prefetch``, the
  pages held by it alone); (b) the worker reports the plan's reads in a
  later result, with those that failed; only then the pages before the
  first failure become host-only nodes (the normal load path then applies),
  the rest are freed and their tokens computed; a failed block leaves the
  index.
- *Waiting*: the request is passed over by admission while its prefetch is
  out, as ``policy`` says (``may_stop_waiting``); a request that stopped
  waiting computes the tokens, and the prefetch, when reported, still fills
  the tree for whoever comes next. Others are admitted meanwhile.
- *Worker loss* (``reset``): the host pool is gone, so every prefetch and
  planned copy goes; the index goes too, since the group that comes back
  may not see the same folder: it reports what its folder holds
  (``Scheduler.note_stored_blocks``), and files that survived a process
  restart on the same node are found again that way.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler_service.core.ids import (
    BLOCK_HASH_TYPE,
    StorageCopies,
    StorageReadsDone,
    id_array,
)
from scheduler_service.core.kv.storage_index import StorageIndex

# A request starts at most this many prefetches: a prefetch whose prefix
# left the tree before it was reported is dropped, and must not repeat.
MAX_PREFETCHES_PER_REQUEST = 2


@dataclass(slots=True, eq=False)
class Prefetch:
    """Reads of ``hashes`` into host pages ``host`` for the prefix ``key``:
    tokens [start, len(key)) are the pages read, [0, start) what the match
    had in the tree when it was planned."""

    rid: str
    namespace: str | None
    key: array
    start: int
    hashes: array
    host: array
    started: float
    step_id: int = 0  # the plan carrying the reads (0: the plan being built)
    offset: int = 0  # index of the first read in that plan's storage_reads
    released: bool = False  # its request no longer waits for it


@dataclass(slots=True)
class StorageStats:
    written_pages: int = 0  # planned writes
    read_pages: int = 0  # planned reads
    failed_reads: int = 0
    prefetches: int = 0
    timeouts: int = 0  # requests that stopped waiting before the report
    dropped_pages: int = 0  # read whole, but their prefix had left the tree


class StorageTier:
    def __init__(
        self,
        capacity_pages: int,
        page_size: int,
        *,
        threshold: int,
        policy: str,
        timeout_base_s: float,
        timeout_per_ki_token_s: float,
        timeout_max_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.index = StorageIndex(capacity_pages)
        self.page_size = page_size
        self.threshold = threshold
        self.policy = policy
        self.timeout = (timeout_base_s, timeout_per_ki_token_s, timeout_max_s)
        self.clock = clock
        self.stats = StorageStats()
        self._write_hashes = array(BLOCK_HASH_TYPE)
        self._write_host = id_array()
        self._building: list[Prefetch] = []
        self._sent: dict[int, list[Prefetch]] = {}
        self.by_rid: dict[str, Prefetch] = {}

    # ----------------------------------------------------------- planning
    @property
    def pending(self) -> bool:
        """Whether the plan being built carries file-tier copies."""
        return bool(self._write_hashes) or bool(self._building)

    @property
    def outstanding(self) -> bool:
        """Whether reads sent are not reported yet."""
        return bool(self._sent)

    def plan_write(self, block_hash: int, host_page: int) -> list[int]:
        """Write ``host_page`` to the file of ``block_hash`` on the plan being
        built; the hashes the index forgot to make room."""
        self._write_hashes.append(block_hash)
        self._write_host.append(host_page)
        self.stats.written_pages += 1
        return self.index.add(block_hash)

    def cancel_writes(self, host_pages: Iterable[int]) -> list[int]:
        """The host pages were freed before the plan was sent (their node was
        dropped): their writes must not go (the pages may be refilled by a
        later write-back of the same plan). The hashes forgotten."""
        gone = set(host_pages)
        if not gone or not self._write_host:
            return []
        keep_h, keep_p = array(BLOCK_HASH_TYPE), id_array()
        forgot: list[int] = []
        for h, p in zip(self._write_hashes, self._write_host, strict=True):
            if p in gone:
                if self.index.discard(h):
                    forgot.append(h)
            else:
                keep_h.append(h)
                keep_p.append(p)
        self._write_hashes, self._write_host = keep_h, keep_p
        return forgot

    def plan_read(self, prefetch: Prefetch) -> None:
        self._building.append(prefetch)
        self.by_rid[prefetch.rid] = prefetch
        self.stats.prefetches += 1
        self.stats.read_pages += len(prefetch.host)

    def take(self, step_id: int) -> tuple[StorageCopies | None, StorageCopies | None]:
        """The writes and reads planned since the last plan, for plan
        ``step_id`` (None: none); the reads' prefetches wait for its report."""
        writes = reads = None
        if self._write_hashes:
            writes = StorageCopies(self._write_hashes, self._write_host)
            self._write_hashes, self._write_host = array(BLOCK_HASH_TYPE), id_array()
        if self._building:
            hashes, host = array(BLOCK_HASH_TYPE), id_array()
            for p in self._building:
                p.step_id, p.offset = step_id, len(hashes)
                hashes += p.hashes
                host += p.host
            reads = StorageCopies(hashes, host)
            self._sent[step_id] = self._building
            self._building = []
        return writes, reads

    # ------------------------------------------------------------ waiting
    def may_stop_waiting(self, prefetch: Prefetch) -> bool:
        """Whether the request may go on without its prefetch's report."""
        policy = self.policy
        if policy == "wait_complete":
            return False
        if policy == "timeout":
            base, per_ki, most = self.timeout
            tokens = len(prefetch.hashes) * self.page_size
            limit = min(most, base + per_ki * tokens / 1024)
            if self.clock() - prefetch.started <= limit:
                return False
        return True

    # ------------------------------------------------------------ reports
    def reported(self, done: StorageReadsDone) -> list[tuple[Prefetch, int, list[int]]]:
        """The worker finished plan ``done.step_id``'s reads: per prefetch,
        how many leading pages came whole and the hashes of those that
        failed (they leave the index)."""
        prefetches = self._sent.pop(done.step_id, None)
        if prefetches is None:
            raise RuntimeError(f"a report of storage reads for step {done.step_id}, which had none")
        failed = set(done.failed)
        total = sum(len(p.hashes) for p in prefetches)
        if any(not 0 <= i < total for i in failed):
            raise RuntimeError(f"step {done.step_id}: failed reads {sorted(failed)} of {total}")
        out: list[tuple[Prefetch, int, list[int]]] = []
        for p in prefetches:
            good = len(p.hashes)
            bad: list[int] = []
            for j, h in enumerate(p.hashes):
                if p.offset + j in failed:
                    good = min(good, j)
                    bad.append(h)
                    self.index.discard(h)
                else:
                    self.index.touch(h)
            self.stats.failed_reads += len(bad)
            if self.by_rid.get(p.rid) is p:
                del self.by_rid[p.rid]
            out.append((p, good, bad))
        return out

    # ------------------------------------------------------------- whole
    def reset(self) -> None:
        """The worker group is gone: its host pool, its reports, and what its
        folder held as far as this scheduler knows."""
        self.index.clear()
        self._write_hashes, self._write_host = array(BLOCK_HASH_TYPE), id_array()
        self._building = []
        self._sent.clear()
        self.by_rid.clear()

    def prefetches(self) -> list[Prefetch]:
        return [*self._building, *(p for ps in self._sent.values() for p in ps)]

    def check(self, host_holders: dict[int, int]) -> None:
        """Each prefetch's host pages are added to ``host_holders``; its
        columns agree; every waiting request's prefetch is one of these."""
        if len(self._write_hashes) != len(self._write_host):
            raise AssertionError("a planned storage write lacks its page or hash")
        for p in self._write_host:
            if p not in host_holders:
                raise AssertionError(f"a storage write reads host page {p}, which no node holds")
        live = self.prefetches()
        for p in live:
            if len(p.hashes) != len(p.host) or not p.hashes:
                raise AssertionError(f"prefetch of {p.rid} has {len(p.host)} pages for its reads")
            if len(p.key) != p.start + len(p.hashes) * self.page_size:
                raise AssertionError(f"prefetch of {p.rid} has a key that does not fit its reads")
            for page in p.host:
                host_holders[page] = host_holders.get(page, 0) + 1
        ids = {id(p) for p in live}
        for rid, p in self.by_rid.items():
            if p.rid != rid or id(p) not in ids:
                raise AssertionError(f"{rid} waits for a prefetch that is not out")
        for step_id, ps in self._sent.items():
            if any(p.step_id != step_id for p in ps):
                raise AssertionError(f"a prefetch filed under step {step_id} is not of it")
