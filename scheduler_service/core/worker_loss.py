"""Starting over after the worker group was lost.

The worker's KV pages are gone with it, but the scheduler holds every
request's tokens: each request that was running (or part-way through its
prefill) goes back to wait with the output it already has, exactly like a
retracted request, and re-prefills prompt + output on the worker that comes
back. Results of plans that were in flight are lost; the tokens they would
have carried are simply sampled again (same context, so the same token for
greedy decoding), and nothing already delivered is delivered twice because
deliveries only ever come from ``update()``.
"""

from __future__ import annotations

import structlog

from scheduler_service.core.request import Request, RequestState
from scheduler_service.core.scheduler_base import SchedulerBase

logger = structlog.get_logger(__name__)


class WorkerLossMixin(SchedulerBase):
    def reset_after_worker_loss(self, num_pages: int | None = None) -> list[Request]:
        """Drop the radix cache, the page pool's state and the plans in flight;
        send every request that holds KV back to wait, keeping its output.

        ``num_pages``: the pool size of the worker group that came back (None:
        unchanged). Safe to call again while nothing ran in between (e.g. once
        when the loss is seen, once more when the new group's size is known).
        Returns the requests sent back to wait.
        """
        holders: list[Request] = self.running.reqs()
        if self.chunked is not None:
            holders.append(self.chunked)
        # max_new_tokens == 0 requests whose prefill was in flight sit in no
        # queue: only the in-flight record knows them.
        for rec in self._inflight:
            holders.extend(
                r
                for r, epoch in rec.prefill_only
                if r.epoch == epoch and r.state is RequestState.PREFILLING
            )
        for req in self.running.reqs():
            self.running.remove(req)
        self.chunked = None
        now = self._clock()
        for req in holders:
            # No release: the pool and the cache are wiped below, and
            # inserting pages whose contents are gone would poison the cache.
            req.pages = []
            req.tree_pages = 0
            req.last_node = None
            req.kv_len = 0
            req.on_worker = False
            req.move_to(RequestState.RETRACTED)
            req.epoch += 1  # anything still arriving for the old plans is stale
            req.pending = 0
            req.times.queue_entry = now
        # The oldest first, ahead of the requests that never ran.
        holders.sort(key=lambda r: r.times.arrival)
        self.waiting[:0] = holders
        for req in self.waiting:  # matches point into the cache being dropped
            req.match_pages, req.match_node, req.match_len = [], None, 0
        self._inflight.clear()
        self._leaves.clear()  # the new worker holds no request state to drop
        self._admission_stuck = False
        self.cache.reset()  # emits AllBlocksCleared for the cache-aware router
        self.pool.reset(num_pages)
        self.stats.worker_losses += 1
        self.stats.worker_loss_requeues += len(holders)
        if self.on_requeue is not None:
            for req in holders:
                self.on_requeue(req, "worker loss")
        logger.info(
            "worker state dropped",
            requeued=len(holders),
            waiting=len(self.waiting),
            num_pages=self.pool.num_pages,
        )
        return holders

    def resize_pool(self, num_pages: int) -> None:
        """Take the page count of the worker group that came back; only while
        nothing holds KV (between reset_after_worker_loss and the next step)."""
        if self.pool.num_free != self.pool.num_pages or self.cache.cached_pages or self._inflight:
            raise RuntimeError("the page pool can only be resized while it is empty")
        self.pool.reset(num_pages)
