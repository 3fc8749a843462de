"""The file tier's read reports of a tensor-parallel group: each rank reads
its own shard of a page from its own folder and reports a plan's reads
when its reader is done, so ranks report a plan in different results and
may fail different reads. A plan's reads are done for the scheduler once
every rank reported them, and a read failed if it failed on any rank (a
page whole on one rank and not on another is no page)."""

from __future__ import annotations

from protos import worker_pb2 as pb


class StorageReports:
    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        # step id -> each rank's failed indices (None: not reported yet)
        self._pending: dict[int, list[set[int] | None]] = {}

    def reset(self) -> None:
        """A new session: the old one's reads are never reported."""
        self._pending.clear()

    def merge(self, results: list[pb.StepResult]) -> None:
        """Put on ``results[0]`` (the result the engine reads) the reports of
        the plans every rank has now reported, failed reads merged."""
        if self.ranks == 1 or not any(r.storage_done for r in results):
            return
        for rank, r in enumerate(results):
            for d in r.storage_done:
                seen = self._pending.setdefault(d.step_id, [None] * self.ranks)
                seen[rank] = set(d.failed)
        done = []
        for step_id in sorted(self._pending):
            seen = self._pending[step_id]
            if all(s is not None for s in seen):
                failed = set().union(*(s for s in seen if s is not None))
                done.append(pb.StorageReadsDone(step_id=step_id, failed=sorted(failed)))
                del self._pending[step_id]
        del results[0].storage_done[:]
        results[0].storage_done.extend(done)
