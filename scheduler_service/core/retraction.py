"""Decode steps, and sending running requests back to wait (retraction,
preemption) when memory runs out."""

from __future__ import annotations

import structlog

from scheduler_service.core.plan import ScheduledRequest
from scheduler_service.core.request import FinishAbort, Request, RequestState
from scheduler_service.core.scheduler_base import SchedulerBase

logger = structlog.get_logger(__name__)


class RetractionMixin(SchedulerBase):
    def _schedule_decode(self) -> list[ScheduledRequest]:
        if not self.running:
            return []
        cfg = self.config
        candidates = self.running.decode_candidates()
        retracted, ready = self.running.make_room_for_decode(
            self._retract, self._retract_chunked, self._abort_oom, bool(self._inflight), candidates
        )
        if retracted:
            reqs = self.running.reqs()
            decoded = sum(len(r.output_ids) for r in reqs)
            budget = sum(r.sampling.max_new_tokens for r in reqs)
            estimate = min(1.0, (decoded + cfg.retract_decode_steps * len(reqs)) / max(budget, 1))
            self.new_token_ratio = max(self.new_token_ratio, estimate)
            logger.info(
                "retracted requests to fit decode",
                retracted=retracted,
                running=len(reqs),
                new_token_ratio=round(self.new_token_ratio, 3),
            )
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio
            )
        if not ready:
            return []
        if retracted:  # otherwise the batch, and so its candidates, did not change
            candidates = self.running.decode_candidates()
        return self.running.prepare_decode(candidates) if candidates else []

    def _requeue(self, req: Request) -> None:
        """Release a running or chunked request's KV and send it back to wait."""
        self.kv.release(req, cache_tokens=True)
        self._leave(req)
        req.move_to(RequestState.RETRACTED)
        req.epoch += 1
        req.pending = 0
        req.times.queue_entry = self._clock()

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self._requeue(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.append(req)
        if self.on_requeue is not None:
            self.on_requeue(req, "retraction")

    def _preempt(self, req: Request) -> None:
        """Called by the adder; the adder queues the request after admission."""
        self.running.remove(req)
        self._requeue(req)
        req.preemptions += 1
        self.stats.preemptions += 1
        if self.on_requeue is not None:
            self.on_requeue(req, "preemption")

    def _retract_chunked(self) -> bool:
        req = self.chunked
        if req is None:
            return False
        self.chunked = None
        self._requeue(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, req)
        if self.on_requeue is not None:
            self.on_requeue(req, "retraction")
        return True

    def _abort_oom(self, req: Request) -> None:
        logger.warning(
            "out of memory even after retraction",
            request_id=req.rid,
            trace_id=req.trace_id,
            tokens=req.num_tokens,
        )
        self.stats.oom_aborts += 1
        self._finish(
            req,
            FinishAbort(
                "out of memory: the KV cache cannot hold this request even after retracting "
                "all others"
            ),
        )
