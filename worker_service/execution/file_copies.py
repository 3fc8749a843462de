"""The file tier's copies between the host KV pool and the files
(device/kv_file_store.py), as a plan carries them (protos/worker.proto, StepPlan):

- writes: each host page is copied aside when the plan runs (after its
  write-backs: on CUDA the copy stream is waited for first), before the
  plan is answered; a writer thread puts the copies in files later (a block
  already stored is only touched). The host page may be reused at once.
- reads: a reader thread fills each host page from its file; nothing else
  touches those pages until the plan's reads are reported, all at once
  (``take_done``), in a later result. A page whose file is missing,
  truncated, corrupt or foreign is a failed read; its page holds nothing
  usable.

A host page's bytes over every layer are not contiguous in the pool (one
tensor per layer), so a file's payload is the page of layer 0, then layer
1, and so on. ``forget`` (a new session) waits for the reads in flight and
drops their reports: the next scheduler never planned them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_file_store import KvFileStore
from worker_service.execution.plan import StorageCopies, StorageReadsDone
from worker_service.telemetry.metrics import FileCounts

logger = structlog.get_logger(__name__)

# Bytes of pages copied aside and not yet in files, at most: past it a
# plan's writes are dropped (counted as failed writes; the scheduler's index
# is a belief, a later read of such a block is a miss).
MAX_WRITE_BACKLOG_BYTES = 1 << 30
CLOSE_FLUSH_S = 10.0  # at shutdown: how long the backlog may take to reach the files


@dataclass(slots=True)
class _Reads:
    generation: int
    step_id: int
    hashes: np.ndarray
    pages: np.ndarray


class HostKvFiles:
    """``host``'s pages to and from ``store`` (module docstring)."""

    def __init__(self, host: HostKvPool, store: KvFileStore) -> None:
        if store.page_nbytes != host.bytes_per_page:
            raise ValueError(
                f"the file store's pages are {store.page_nbytes} bytes, "
                f"the host pool's {host.bytes_per_page}"
            )
        self.host = host
        self.store = store
        # Every layer's host tensor as bytes: [layers, pages, page bytes].
        self._bytes = host.page_bytes()
        self._cond = threading.Condition()
        self._generation = 0
        self._reads_out = 0  # plans whose reads are not reported yet (this generation)
        self._done: list[StorageReadsDone] = []
        self._backlog = 0  # bytes copied aside, not yet written
        self.files_read = self.files_written = self.read_failed = self.write_failed = 0
        self._writes: queue.SimpleQueue[tuple[np.ndarray, np.ndarray] | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[_Reads | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-file-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-file-reader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ the plan
    def run(self, step_id: int, storage: StorageCopies) -> None:
        """A validated plan's file copies, after its write-backs."""
        if storage.num_writes:
            nbytes = storage.num_writes * self.store.page_nbytes
            with self._cond:
                room = self._backlog + nbytes <= MAX_WRITE_BACKLOG_BYTES
                if room:
                    self._backlog += nbytes
            if not room:
                logger.warning(
                    "kv file writes dropped: the backlog is full", pages=storage.num_writes
                )
                self.write_failed += storage.num_writes
            else:
                self.host.settle()
                pages = torch.from_numpy(storage.write_host)
                # [pages, layers, page bytes]: each file's payload contiguous.
                copied = self._bytes.index_select(1, pages).transpose(0, 1).contiguous()
                self._writes.put((storage.write_hashes.copy(), copied.numpy()))
        if storage.num_reads:
            with self._cond:
                self._reads_out += 1
                reads = _Reads(self._generation, step_id, storage.read_hashes, storage.read_host)
            self._reads.put(reads)

    def take_done(self) -> list[StorageReadsDone]:
        """The reports of plans whose reads all finished since the last call."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def wait_done(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a report while reads are out (an IDLE
        plan sent to collect them); at once when none are out or one is ready."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or not self._reads_out, timeout_s)

    def forget(self) -> None:
        """A new session: wait for the reads in flight (their host pages are
        the new scheduler's) and drop every report."""
        with self._cond:
            self._generation += 1
            self._cond.wait_for(lambda: not self._reads_out)
            self._done = []

    def counts(self) -> FileCounts:
        """Pages read, failed reads, pages written, failed writes so far."""
        return FileCounts(self.files_read, self.read_failed, self.files_written, self.write_failed)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the pages copied aside to be in files."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._backlog, timeout_s)

    def close(self) -> None:
        """Stop the threads, the backlog written first (at most CLOSE_FLUSH_S)."""
        if not self.flush(CLOSE_FLUSH_S):
            logger.warning("kv file writes left unwritten at shutdown", bytes=self._backlog)
        self._writes.put(None)
        self._reads.put(None)

    # ------------------------------------------------------------- threads
    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            hashes, pages = job
            for h, page in zip(hashes.tolist(), pages, strict=True):
                try:
                    ok = self.store.write(h, page)
                except OSError as e:
                    logger.warning("kv file write failed", block_hash=h, error=str(e))
                    ok = False
                if ok:
                    self.files_written += 1
                else:
                    self.write_failed += 1
            with self._cond:
                self._backlog -= len(hashes) * self.store.page_nbytes
                self._cond.notify_all()

    def _read_loop(self) -> None:
        buf = np.empty(self.store.page_nbytes, np.uint8)
        staged = torch.from_numpy(buf).view(self.host.kv.num_layers, -1)
        while (job := self._reads.get()) is not None:
            failed: list[int] = []
            pairs = zip(job.hashes.tolist(), job.pages.tolist(), strict=True)
            for i, (h, page) in enumerate(pairs):
                try:
                    ok = self.store.read_into(h, buf)
                except OSError as e:
                    logger.warning("kv file read failed", block_hash=h, error=str(e))
                    ok = False
                if ok:
                    self._bytes[:, page].copy_(staged)
                    self.files_read += 1
                else:
                    failed.append(i)
                    self.read_failed += 1
            with self._cond:
                self._reads_out -= 1
                if job.generation == self._generation:
                    self._done.append(StorageReadsDone(job.step_id, failed))
                self._cond.notify_all()
