"""The scheduler's loop body: ``step() -> StepPlan`` and ``update(StepResult)``.

Each step is a prefill (admit waiting requests, continue a chunked one),
optionally mixed with the decode batch, or else a decode of the running
batch (retracting requests when pages run out), as in SGLang.

Overlap: ``step()`` for N+1 may run before ``update()`` for N. Decode entries
then name "the last sampled token", in-flight tokens are counted in
``Request.pending``, and results are matched to the request *epoch* they were
planned for: a request retracted, preempted or finished since has its late
token discarded (a finished one's extra step only wrote a page that is freed).
"""

from __future__ import annotations

from scheduler_service.core.admission import AdmissionMixin
from scheduler_service.core.finish import check_finish
from scheduler_service.core.integrity import check_scheduler_integrity
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.plan import ForwardMode, RequestOutput, StepPlan, StepResult
from scheduler_service.core.request import FinishAbort, FinishLength, Request, RequestState
from scheduler_service.core.retraction import RetractionMixin
from scheduler_service.core.sampling import InvalidRequestError
from scheduler_service.core.scheduler_base import InFlight, ProtocolError
from scheduler_service.core.worker_loss import WorkerLossMixin


class Scheduler(AdmissionMixin, RetractionMixin, WorkerLossMixin):
    # ============================================================ requests
    def add_request(self, req: Request) -> None:
        """Queue a request; raise InvalidRequestError if it can never run."""
        if req.rid in self.requests:
            raise InvalidRequestError(f"request id {req.rid!r} is already in use")
        if req.state is not RequestState.WAITING or req.output_ids or req.pages:
            raise InvalidRequestError(f"request {req.rid!r} is not a fresh request")
        req.validate(self.config.vocab_size, self.config.context_len)
        capacity = self.pool.num_pages * self.pool.page_size
        if len(req.prompt_ids) + 1 > capacity:
            raise InvalidRequestError(
                f"request {req.rid}: the prompt has {len(req.prompt_ids)} tokens but the KV "
                f"cache holds {capacity} tokens in all"
            )
        now = self._clock()
        req.times.arrival = req.times.queue_entry = now
        self.waiting.append(req)
        self.requests[req.rid] = req

    def abort(self, rid: str, message: str = "aborted by the client", emit: bool = True) -> bool:
        """Finish a live request at once, freeing its pages; False if unknown.
        ``emit=False``: the caller tells the client itself (no finish delta)."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._finish(req, FinishAbort(message), emit=emit)
        return True

    def drain(self) -> list[RequestDelta]:
        """Token deltas and finishes since the last call, in order."""
        out, self._outbox = self._outbox, []
        return out

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_idle(self) -> bool:
        return not (self.requests or self._inflight or self._leaves)

    # ================================================================ step
    def step(self) -> StepPlan | None:
        """Plan the next forward; None when there is nothing to send."""
        mixed = self.config.enable_mixed_chunk and len(self.running) > 0
        decode_reqs = self.running.decode_candidates() if mixed else []
        prefill = self._schedule_prefill(len(decode_reqs))
        if not prefill:
            decode_entries = self._schedule_decode()
            if not decode_entries:
                return self._idle_plan()
            plan = StepPlan(self._next_step_id(), ForwardMode.DECODE, leaves=self._take_leaves())
            record = InFlight(plan.step_id, {}, 0)
            self.stats.decode_steps += 1
        else:
            plan = StepPlan(self._next_step_id(), ForwardMode.PREFILL, leaves=self._take_leaves())
            record = InFlight(plan.step_id, {}, 0)
            self._plan_prefill(prefill, plan, record)
            # Decode the batch in the same forward if its pages fit after the
            # prefill's (requests preempted for the prefill are gone).
            decode_reqs = [r for r in decode_reqs if r.state is RequestState.DECODING]
            decode_entries = []
            if decode_reqs and self.running.pages_needed(decode_reqs) <= self.kv.available_pages():
                decode_entries = self.running.prepare_decode(decode_reqs)
                plan.mode = ForwardMode.MIXED
                self.stats.mixed_steps += 1
            else:
                self.stats.prefill_steps += 1
        plan.entries.extend(decode_entries)
        entries = record.entries
        requests = self.requests
        for e in decode_entries:
            req = requests[e.rid]
            entries[e.rid] = (req, req.epoch, True)
        record.expected_tokens += len(decode_entries)
        self._inflight.append(record)
        self.stats.steps += 1
        return plan

    def _idle_plan(self) -> StepPlan | None:
        if not self.running and not self.waiting and self.chunked is None:
            self.new_token_ratio = self.config.start_new_token_ratio
        self._abort_unschedulable()
        if not self._leaves:
            return None
        plan = StepPlan(self._next_step_id(), ForwardMode.IDLE, leaves=self._take_leaves())
        self._inflight.append(InFlight(plan.step_id, {}, 0))
        return plan

    # ============================================================== update
    def update(self, result: StepResult) -> None:
        """Apply the worker's result for the oldest plan in flight."""
        if not self._inflight or self._inflight[0].step_id != result.step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ProtocolError(f"result for step {result.step_id}, expected step {expected}")
        record = self._inflight.popleft()
        tokens = sum(1 for out in result.outputs if out.token_id is not None)
        if tokens != record.expected_tokens:
            raise ProtocolError(
                f"step {record.step_id}: {tokens} sampled tokens for "
                f"{record.expected_tokens} sampling entries"
            )
        now = self._clock()
        entries = record.entries
        stats = self.stats
        outbox = self._outbox
        eos_ids = self.config.eos_token_ids
        checks_strings = self._stop_strings is not None
        for out in result.outputs:
            item = entries.get(out.rid)
            if item is None:
                raise ProtocolError(f"step {record.step_id} has no entry for {out.rid!r}")
            req, epoch, samples = item
            token = out.token_id
            if samples != (token is not None):
                raise ProtocolError(f"step {record.step_id}: {out.rid} sampled {samples=}")
            if req.epoch != epoch:
                if samples:
                    stats.discarded_tokens += 1
                continue
            if token is None or out.prompt_logprobs:
                self._apply_output(req, out, now)
                continue
            # A plain sampled token (the decode case): _apply_output inlined,
            # check_finish only called when one of its conditions can hold.
            delta = RequestDelta(req, [token], [out.logprobs])
            req.pending -= 1
            output_ids = req.output_ids
            output_ids.append(token)
            stats.generated_tokens += 1
            times = req.times
            if times.first_token is None:
                times.first_token = now
            outbox.append(delta)
            sp = req.sampling
            n = len(output_ids)
            if n >= sp.max_new_tokens or (
                n > sp.min_new_tokens
                and (
                    (checks_strings and sp.stop_strs)
                    or (not sp.ignore_eos and (token in sp.stop_token_ids or token in eos_ids))
                )
            ):
                reason = check_finish(req, token, eos_ids, self._stop_strings)
                if reason is not None:
                    delta.finished = True
                    self._finish(req, reason, emit=False)
        for req, epoch in record.prefill_only:
            if req.epoch == epoch:
                self._finish(req, FinishLength(req.sampling.max_new_tokens))

    def _apply_output(self, req: Request, out: RequestOutput, now: float) -> None:
        token = out.token_id
        if token is None:  # a prefill chunk: only prompt logprobs can come back
            delta = RequestDelta(req, [], [])
            self._take_prompt_logprobs(req, out, delta)
            if delta.prompt_logprobs:
                self._outbox.append(delta)
            return
        delta = RequestDelta(req, [token], [out.logprobs])
        if out.prompt_logprobs:
            self._take_prompt_logprobs(req, out, delta)
        req.pending -= 1
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now
        self._outbox.append(delta)
        reason = check_finish(req, token, self.config.eos_token_ids, self._stop_strings)
        if reason is not None:
            delta.finished = True
            self._finish(req, reason, emit=False)

    @staticmethod
    def _take_prompt_logprobs(req: Request, out: RequestOutput, delta: RequestDelta) -> None:
        """Deliver each prompt position once, even if a retracted request's
        re-prefill computes it again."""
        logprobs = out.prompt_logprobs or []
        start = out.prompt_logprobs_start
        skip = max(0, req.prompt_logprobs_sent - start)
        logprobs = logprobs[skip:]
        start += skip
        if not logprobs:
            return
        req.prompt_logprobs_sent = start + len(logprobs)
        if req.prompt_logprobs_sent >= len(req.prompt_ids):
            req.prompt_logprobs_pending = False
        delta.prompt_logprobs = logprobs
        delta.prompt_logprobs_start = start

    def check_integrity(self) -> None:
        """Every page is exactly one of free, cached-unlocked, or held (by a
        request's own pages or a locked cache node); every live request is in
        exactly one place, in a state that fits it."""
        check_scheduler_integrity(self)


__all__ = ["ProtocolError", "Scheduler"]
