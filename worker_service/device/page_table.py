"""Every held request's page ids, one row each of an int32 table on the device.

Flattening each sequence's whole page list (Python) into numpy every step
would cost, at batch 256 with 32k-token contexts, tens of milliseconds of
host work per step, more than the GPU step it feeds. The table changes
only where a plan changes it (a join takes a row, extends and decodes append
pages, a drafted step trims them, a leave frees the row), so
the runner applies those deltas here and a step reads the rows it needs:
FlashInfer's flat page indices are gathered on the device from the rows
(``gather``), the host doing O(batch) work (row ids, page counts, their
cumulative sum) plus O(pages changed). SGLang keeps its ``req_to_token`` the
same way, on the device, and builds FlashInfer's indices from it with a
small kernel; here ``gather`` is three torch ops.

A host mirror (numpy) holds the same values: the runner writes it at once,
the step's KV write positions are read from it (O(tokens computed)), and on
the CPU it *is* the table (the device tensor shares its memory, ``sync`` has
nothing to copy). On CUDA the cells written since the last step go up in one
non-blocking copy from pinned memory at ``sync``, stream-ordered after the
kernels of earlier steps that read the old values and before the ones that
read the new. Trims and leaves change only row lengths: cells past a row's
length are never read.

Rows are the worker's own (``acquire``/``release``, smallest free first), not
the wire's slot numbers, so a plan cannot make the table large; rows and
columns double when a request or a sequence needs more (a device-to-device
copy, rare, amortised).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np
import structlog
import torch

from worker_service.device.transfer import to_device

logger = structlog.get_logger(__name__)

_INT32_MAX = 2**31 - 1


class PageTable:
    """Rows of page ids (see the module docstring); ``lengths[row]`` pages are valid."""

    def __init__(
        self,
        device: torch.device | str,
        *,
        rows: int = 64,
        columns: int = 64,
        separate: bool | None = None,
    ) -> None:
        """``separate``: the device table is its own memory, updated by ``sync``
        (default: unless the device is the host; tests set it on the CPU to run
        the upload path)."""
        self.device = torch.device(device)
        self._shared = self.device.type == "cpu" if separate is None else not separate
        self._host = np.zeros((max(rows, 1), max(columns, 1)), np.int32)
        self.lengths = np.zeros(self._host.shape[0], np.int64)
        self._free = list(range(self._host.shape[0]))  # a heap: smallest row first
        # (row, first column, end column) of cells written since the last sync
        self._dirty: list[tuple[int, int, int]] = []
        self._table = self._new_device_table()

    # ---- the table --------------------------------------------------------------

    @property
    def on_host(self) -> bool:
        """The mirror is the table (the device is the host): nothing to upload."""
        return self._shared

    @property
    def host(self) -> np.ndarray:
        """(rows, columns) int32, current as of the last delta applied."""
        return self._host

    @property
    def table(self) -> torch.Tensor:
        """(rows, columns) int32 on the device, current as of the last ``sync``."""
        return self._table

    @property
    def stride(self) -> int:
        """Cells per row: row r's page j is ``table.view(-1)[r * stride + j]``."""
        return int(self._host.shape[1])

    def _new_device_table(self) -> torch.Tensor:
        if self.on_host:
            return torch.from_numpy(self._host)
        return torch.zeros(self._host.shape, dtype=torch.int32, device=self.device)

    # ---- deltas (the runner's page bookkeeping) ---------------------------------

    def acquire(self) -> int:
        """A free row, emptied; the smallest one (the table grows if none is free)."""
        if not self._free:
            self._grow(rows=2 * self._host.shape[0])
        row = heapq.heappop(self._free)
        self.lengths[row] = 0
        return row

    def release(self, row: int) -> None:
        """The row's request left; its cells are never read again until reused."""
        self.lengths[row] = 0
        heapq.heappush(self._free, row)

    def append(self, row: int, pages: Sequence[int]) -> None:
        """Pages appended to the row (its sequence grew)."""
        if not pages:
            return
        start = int(self.lengths[row])
        end = start + len(pages)
        if end > self._host.shape[1]:
            self._grow(columns=max(2 * self._host.shape[1], end))
        self._host[row, start:end] = pages
        self.lengths[row] = end
        if not self.on_host:
            self._dirty.append((row, start, end))

    def truncate(self, row: int, keep: int) -> None:
        """The row keeps its first ``keep`` pages (a drafted step's rejected tail)."""
        self.lengths[row] = min(int(self.lengths[row]), keep)

    def clear(self) -> None:
        """Every row free (the worker dropped all requests)."""
        self.lengths[:] = 0
        self._free = list(range(self._host.shape[0]))
        self._dirty.clear()  # no row is read before it is written again

    def _grow(self, *, rows: int = 0, columns: int = 0) -> None:
        old_rows, old_cols = self._host.shape
        rows, columns = max(rows, old_rows), max(columns, old_cols)
        if rows * columns > _INT32_MAX:
            raise MemoryError(f"page table of {rows} x {columns} exceeds int32 indexing")
        host = np.zeros((rows, columns), np.int32)
        host[:old_rows, :old_cols] = self._host
        old_table = self._table
        self._host = host
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, np.int64)])
        for r in range(old_rows, rows):
            heapq.heappush(self._free, r)
        self._table = self._new_device_table()
        if not self.on_host:  # stream-ordered after the kernels that read the old one
            self._table[:old_rows, :old_cols].copy_(old_table)
        logger.info("page table grown", rows=rows, columns=columns)

    # ---- per step ---------------------------------------------------------------

    def sync(self) -> None:
        """Copy the cells written since the last sync to the device (CUDA): one
        pinned non-blocking copy and one scatter, O(cells written)."""
        if not self._dirty:
            return
        spans = np.array(self._dirty, dtype=np.int64).reshape(-1, 3)
        self._dirty.clear()
        counts = spans[:, 2] - spans[:, 1]
        starts = spans[:, 0] * self.stride + spans[:, 1]
        ends = np.cumsum(counts)
        flat = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(
            starts - (ends - counts), counts
        )
        values = self._host.reshape(-1)[flat].astype(np.int64)
        index_t, values_t = to_device([flat, values], self.device)
        self._table.view(-1).index_copy_(0, index_t, values_t.to(torch.int32))

    def gather(
        self, bases: torch.Tensor, counts: torch.Tensor, total: int, *, out: torch.Tensor
    ) -> torch.Tensor:
        """FlashInfer's flat page indices on the device, into ``out[:total]``:
        for each sequence i, the ``counts[i]`` cells from ``bases[i] + its offset``
        in the flat table, where ``bases[i] = row_i * stride - (pages before i)``
        (``flat_bases``). int32 device tensors; no host wait (``output_size``)."""
        if total == 0:
            return out[:0]
        index = torch.repeat_interleave(bases, counts, output_size=total)
        index += torch.arange(total, dtype=index.dtype, device=index.device)
        return torch.index_select(self._table.view(-1), 0, index, out=out[:total])

    def flat_bases(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``gather``'s bases (int32, host) for sequences on ``rows`` reading ``counts`` pages."""
        before = np.cumsum(counts) - counts
        return (rows.astype(np.int64) * self.stride - before).astype(np.int32)

    # ---- checks -----------------------------------------------------------------

    def check_integrity(self, expected: Mapping[int, Sequence[int]]) -> None:
        """``expected``: row -> the page list its request holds. Every such row
        holds exactly those pages, on the host and (after a sync) the device;
        every other row is free. Reads the device table (a wait on CUDA): tests."""
        self.sync()
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page-table row is on the free list twice")
        on_device = self._table.cpu().numpy()
        for row, pages in expected.items():
            if row in free:
                raise AssertionError(f"page-table row {row} is held and free")
            n = int(self.lengths[row])
            if n != len(pages):
                raise AssertionError(
                    f"page-table row {row} has {n} pages, its request {len(pages)}"
                )
            if self._host[row, :n].tolist() != list(pages):
                raise AssertionError(f"page-table row {row} differs from its request's pages")
            if on_device[row, :n].tolist() != list(pages):
                raise AssertionError(f"page-table row {row} differs on the device")
        unheld = set(range(self._host.shape[0])) - set(expected)
        if unheld != free:
            raise AssertionError(f"rows neither held nor free: {sorted(unheld - free)[:5]}")
