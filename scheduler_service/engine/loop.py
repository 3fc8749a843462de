"""The core loop: Scheduler.step() -> plan to the workers -> result -> update().

With overlap, plans N+1 (and N+2 at the default depth) are sent before
result N is read, so the worker finds its next plan queued the moment it
finishes a step: it never waits on the network or on this loop's Python, as
long as a result's trip here, one iteration (update, step) and the next
plan's trip back take less than the forwards queued ahead.

The loop talks to the API process through a pipe: requests and aborts come
in between steps; one Outputs message per step goes out.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import structlog

from observability import tracing
from observability.histograms import REQUEST_LATENCY_S, Histogram
from scheduler_service import ipc
from scheduler_service.core.intake import Submission
from scheduler_service.core.outputs import LoadFigures, RequestDelta
from scheduler_service.core.request import FinishAbort, FinishStop, Request
from scheduler_service.core.sampling import InvalidRequestError
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.adapter_loader import AdapterLoader
from scheduler_service.engine.recovery import MAX_STEP_FAILURES, WorkerRecovery
from scheduler_service.engine.request_tracing import RequestTracer
from scheduler_service.engine.wakeup import Wakeup
from scheduler_service.engine.worker_codec import WorkerCodec, WorkerProtocolError
from scheduler_service.engine.worker_group import StepFailed, WorkerError, WorkerGroup

if TYPE_CHECKING:
    from scheduler_service.engine.decode_transfers import DecodeTransfers
    from scheduler_service.engine.prefill_transfers import PrefillTransfers

logger = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.05  # nothing to do: wake up at least this often
CPU_SAMPLE_S = 0.1
# The load's queue figures walk the waiting requests (a millisecond at a few
# thousand): with more waiting than this they are refreshed at most every
# FIGURES_S, not every step (the queue is long then, so steps, and with them
# fresh figures, keep coming).
FIGURES_EVERY_STEP_UP_TO = 64
FIGURES_S = 0.02


class IntegrityFailure(RuntimeError):
    """The scheduler's pages or requests are inconsistent (a bug)."""


class Engine:
    def __init__(
        self,
        sched: Scheduler,
        group: WorkerGroup,
        conn: Connection,
        *,
        overlap_depth: int,
        recovery_timeout_s: float,
        check_integrity: bool = False,
        adapters: AdapterLoader | None = None,
        sliding: bool = False,
        transfers: PrefillTransfers | DecodeTransfers | None = None,
        wakeup: Wakeup | None = None,
    ) -> None:
        """``sliding``: the workers have a sliding pool (WorkerInfo.num_swa_pages);
        ``transfers``: a disaggregated unit's side of the KV transfers, whose
        gRPC threads wake the loop through ``wakeup``."""
        self.sched = sched
        self.group = group
        self.conn = conn
        # Plans in flight beyond the one whose result is awaited: 0 waits for
        # every result before planning (no overlap), 1 is SGLang's overlap.
        self.lag = overlap_depth
        # Debug (--check-integrity): check pool and cache after every step and update.
        self.check_integrity = check_integrity
        self.codec = WorkerCodec(sliding=sliding)
        self.transfers = transfers
        self.wakeup = wakeup
        self.running = True
        self.adapters = adapters or AdapterLoader(sched, group, max_rank=0)
        self.recovery = WorkerRecovery(
            sched, group, recovery_timeout_s, before_open=self._reload_adapters
        )
        self.loss_error = ""  # why the worker streams broke, for the log
        self._failed_rids: set[str] = set()  # the requests of a step a worker failed
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self._cpu_read_at = 0.0
        self._cpu_s = 0.0
        self._figures: LoadFigures | None = None
        self._figures_at = 0.0
        self.queue_time = Histogram(REQUEST_LATENCY_S)
        self._queue_time_changed = False
        self.tracer = RequestTracer() if tracing.enabled() else None
        if self.tracer is not None:
            sched.on_requeue = self.tracer.requeued

    # ----------------------------------------------------------------- loop
    def run(self) -> None:
        try:
            # A lost worker group is waited for (recovery.py): the requests
            # live on here and resume once it is back.
            try:
                self.group.open()
            except WorkerError as e:
                self.loss_error = str(e)
            else:
                if self._loop_until_worker_loss():
                    return
            while self._recover():
                if self._loop_until_worker_loss():
                    return
            self._publish()
        except IntegrityFailure as e:
            # Going on would hand out pages twice or lose them: stop, loudly.
            logger.error("scheduler integrity check failed; stopping", error=str(e))
            self.conn.send(ipc.Failed(str(e), code="INTERNAL"))
        except Exception as e:
            # A bug, not a broken worker: say so (INTERNAL), not "no worker".
            logger.exception("the core loop failed; stopping")
            self.conn.send(ipc.Failed(f"internal error in the scheduler core: {e!r}", "INTERNAL"))

    def _check(self, after: str) -> None:
        try:
            self.sched.check_integrity()
        except Exception as e:
            raise IntegrityFailure(f"scheduler integrity check failed after {after}: {e}") from e

    def _loop_until_worker_loss(self) -> bool:
        """Run the loop; True when it ended (shutdown), False on worker loss."""
        try:
            self._loop()
        except StepFailed as e:
            # Like a loss (the worker's state is gone or out of step), and the
            # plan's requests are charged with it (recovery.step_failed).
            self.loss_error = str(e)
            self._failed_rids = self.sched.rids_in_plan(e.step_id)
            return False
        except WorkerError as e:
            self.loss_error = str(e)
            return False
        return True

    def _loop(self) -> None:
        sched = self.sched
        while self.running:
            idle = sched.is_idle()
            self._read_inbox(block=idle)
            if idle and (ended := self.group.ended()):
                raise WorkerError(ended)  # noticed while idle: ready no more (readiness.py)
            if self.adapters.busy:
                for reply in self.adapters.poll():
                    self.conn.send(reply)
            transfers = self.transfers
            if transfers is not None:
                transfers.pump()
            plan = sched.step()
            if transfers is not None:
                transfers.pump()
            if self.check_integrity:
                self._check("a step")
            if plan is not None:
                self.group.send(self.codec.encode(plan))
                if self.tracer is not None:
                    plan.sent_ns = time.time_ns()
                    self.tracer.planned(plan)
            # The last update's outputs go out once the next plan is on its
            # way: publishing is off the path from a result to the next plan.
            self._publish()
            inflight = sched.in_flight()
            if inflight and (len(inflight) > self.lag or plan is None):
                answered = inflight[0]
                msg = self.group.receive(answered.num_tokens)
                if self.tracer is not None:
                    self.tracer.result(answered)
                self.busy_ms += msg.forward_ms
                self.idle_ms += msg.idle_ms
                try:
                    result = self.codec.decode(msg, answered)
                except WorkerProtocolError as e:
                    raise StepFailed(msg.step_id, f"worker result out of protocol: {e}") from e
                sched.update(result)
                if transfers is not None:
                    transfers.pump()
                if self.check_integrity:
                    self._check("an update")
            elif plan is None and not inflight:
                # Work exists but none can run yet (held siblings): don't spin.
                self._read_inbox(block=True, timeout=0.005)
        self._publish()

    def _recover(self) -> bool:
        """Survive the loss of the worker group; True once it serves again,
        False if the service is shutting down meanwhile."""
        recovery = self.recovery
        self.codec.forget_worker()
        recovery.lost(self.loss_error)
        if self._failed_rids:
            self._fail_struck(recovery.step_failed(self._failed_rids))
            self._failed_rids = set()
        for reply in self.adapters.fail_loading(self.loss_error):
            self.conn.send(reply)
        # AllBlocksCleared and the load go out now: the API process turns
        # not ready while the group is away (api/readiness.py), ready once back.
        self._publish(force=True)
        while self.running:
            if self.transfers is not None:
                self.transfers.pump()  # the lost transfers' cancels go out
            if recovery.try_reconnect():
                self._publish(force=True)
                return True
            if recovery.expired():
                self._fail_all(recovery.message)
            self._read_inbox(block=True, timeout=recovery.wait_s())
        return False

    def _reload_adapters(self) -> None:
        """The group that came back gets every registered adapter before its
        first plan; an adapter that no longer loads ends its requests."""
        sched = self.sched
        for lora_id in self.adapters.reload_all():
            message = f"LoRA adapter {lora_id!r} could not be loaded again after a worker loss"
            sched.abort_adapter_requests(lora_id, message)
            sched.unregister_adapter(lora_id)

    def _fail_struck(self, rids: list[str]) -> None:
        """End the requests whose steps failed too often (UNAVAILABLE with the
        worker's error); the others are re-prefilled as after any loss."""
        if not rids:
            return
        message = (
            f"the worker failed the steps holding this request {MAX_STEP_FAILURES} times "
            f"(the last: {self.loss_error})"
        )
        sched = self.sched
        for rid in rids:
            req = sched.abort(rid, message, emit=False)
            if req is not None:
                self._finished(req)
        logger.error("requests failed after repeated step failures", rids=rids, error=message)
        self.conn.send(ipc.Unavailable(rids, message))

    def _fail_all(self, message: str) -> None:
        """End every request the core holds with UNAVAILABLE (the calls end
        with a status, not a finish)."""
        sched = self.sched
        rids = sched.live_rids()
        for rid in rids:
            req = sched.abort(rid, message, emit=False)
            if req is not None:
                self._finished(req)
        if rids:
            self.conn.send(ipc.Unavailable(rids, message))

    # ---------------------------------------------------------------- inbox
    def _read_inbox(self, block: bool, timeout: float = IDLE_WAIT_S) -> None:
        conn = self.conn
        if block:
            self._publish()  # nothing will run before the wait ends: send what we have
            if self.wakeup is None:
                if not conn.poll(timeout):
                    return
            else:
                wait([conn, self.wakeup], timeout)
                self.wakeup.clear()
        while conn.poll(0):
            self._handle(conn.recv())

    def _handle(self, msg: object) -> None:
        if isinstance(msg, ipc.Submit):
            self._submit(msg)
        elif isinstance(msg, ipc.Abort):
            for rid in msg.rids:
                self.sched.abort(rid, msg.reason)
        elif isinstance(msg, ipc.FlushCache):
            self.conn.send(self._flush(msg.token))
        elif isinstance(msg, ipc.LoadAdapter):
            reply = self.adapters.start_load(msg)
            if reply is not None:
                self.conn.send(reply)
        elif isinstance(msg, ipc.UnloadAdapter):
            self.conn.send(self.adapters.unload(msg))
        elif isinstance(msg, ipc.Shutdown):
            self.running = False
        else:
            logger.error("unknown message from the API process", kind=type(msg).__name__)

    def _submit(self, msg: ipc.Submit) -> None:
        """One call's samples; with n > 1 the later ones wait for the first's
        prefill (``Submission.waits_for``), which the scheduler handles."""
        first, *rest = msg.submissions
        if not self._add(first):
            for sub in rest:
                self.conn.send(ipc.Rejected(sub.rid, "the request's first sample was refused"))
            return
        for sub in rest:
            self._add(sub)

    def _add(self, sub: Submission) -> bool:
        try:
            req = self.sched.submit(sub)
        except InvalidRequestError as e:
            self.conn.send(ipc.Rejected(sub.rid, str(e)))
            return False
        if self.tracer is not None and req.trace_context is not None:
            self.tracer.submitted(req)
        return True

    def _flush(self, token: int) -> ipc.Flushed:
        success, message = self.sched.flush_cache()
        return ipc.Flushed(token, success, message)

    # -------------------------------------------------------------- outputs
    def _publish(self, force: bool = False) -> None:
        """Send the outputs and events since the last call with the load;
        nothing when there are none, unless ``force`` (the load alone)."""
        deltas = self.sched.drain()
        events = self.sched.take_kv_events()
        if not deltas and not events and not force:
            return
        # Plain tokens go as columns (ipc.Outputs), the rest as DeltaOuts.
        out: list[ipc.DeltaOut] = []
        rids: list[str] = []
        tokens: list[int | None] = []
        cached: list[int] = []
        add_rid, add_token, add_cached = rids.append, tokens.append, cached.append
        for d in deltas:
            req = d.req
            ids = d.new_token_ids
            add_rid(req.rid)
            if d.plain:  # the common delta: the checks below are known to pass
                add_token(ids[0])
                add_cached(req.cached_tokens)
            elif (
                d.finished
                or d.holding
                or len(ids) != 1
                or d.prompt_logprobs is not None
                or d.embedding is not None
                or req.logprobs.return_logprob
            ):
                add_token(None)
                add_cached(0)
                out.append(self._delta(d))
            else:
                add_token(ids[0])
                add_cached(req.cached_tokens)
        self.conn.send(ipc.Outputs(out, self.load(), events, rids, tokens, cached))

    def _finished(self, req: Request) -> None:
        times = req.times
        if times.first_scheduled is not None:
            self.queue_time.observe(times.first_scheduled - times.arrival)
            self._queue_time_changed = True
        if self.tracer is not None:
            self.tracer.finished(req)

    def _delta(self, d: RequestDelta) -> ipc.DeltaOut:
        req = d.req
        finish = None
        if d.finished:
            self._finished(req)
            reason = req.finish_reason
            if isinstance(reason, FinishStop):
                if isinstance(reason.matched, str):
                    finish = ipc.Finish("stop", matched_str=reason.matched)
                else:
                    finish = ipc.Finish("stop", matched_token=reason.matched)
            elif isinstance(reason, FinishAbort):
                finish = ipc.Finish("abort", message=reason.message, code=reason.code)
            else:
                finish = ipc.Finish(reason.kind)
            finish.spec_draft_tokens = req.spec_draft_tokens
            finish.spec_accepted_tokens = req.spec_accepted_tokens
        return ipc.DeltaOut(
            req.rid,
            d.new_token_ids,
            d.logprobs if req.logprobs.return_logprob else None,
            d.prompt_logprobs,
            d.prompt_logprobs_start,
            req.cached_tokens,
            finish,
            d.next_token_logprobs if req.logprobs.return_logprob else None,
            d.holding,
            d.embedding,
        )

    def _cpu_seconds(self) -> float:
        """This process's CPU time, read at most every CPU_SAMPLE_S (reading it
        costs most of a millisecond on some virtual machines)."""
        now = time.monotonic()
        if now - self._cpu_read_at >= CPU_SAMPLE_S:
            self._cpu_read_at = now
            self._cpu_s = time.process_time()
        return self._cpu_s

    def _load_figures(self, waiting: int) -> LoadFigures:
        now = time.monotonic()
        if (
            self._figures is None
            or waiting <= FIGURES_EVERY_STEP_UP_TO
            or now - self._figures_at >= FIGURES_S
        ):
            self._figures = self.sched.load_figures()
            self._figures_at = now
        return self._figures

    def load(self) -> ipc.Load:
        sched = self.sched
        page = sched.config.page_size
        used_pages, evictable, total_pages = sched.kv_snapshot()
        running, waiting, live = sched.table_sizes()
        figures = self._load_figures(waiting)
        stats = sched.stats
        queue_time = None
        if self._queue_time_changed:  # only when a request finished since the last snapshot
            self._queue_time_changed = False
            queue_time = self.queue_time.snapshot()
        recovery = self.recovery
        return ipc.Load(
            running=running,
            waiting=waiting,
            used_tokens=(used_pages - evictable) * page,
            total_tokens=total_pages * page,
            cache_hit_rate=stats.cached_tokens / max(stats.prompt_tokens, 1),
            gen_tokens=stats.generated_tokens,
            steps=stats.steps,
            worker_busy_ms=self.busy_ms,
            worker_idle_ms=self.idle_ms,
            core_cpu_s=self._cpu_seconds(),
            max_running_requests=sched.config.max_running_requests,
            retractions=stats.retractions,
            preemptions=stats.preemptions,
            queue_time=queue_time,
            worker_connected=recovery.connected,
            worker_losses=recovery.losses,
            spec_steps=stats.spec_steps,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            worker_recoveries=recovery.recoveries,
            tracked=live,
            waiting_uncached_tokens=figures.waiting_uncached_tokens,
            retracted_waiting=figures.retracted_waiting,
            adapter_slots_used=figures.adapter_slots_used,
            adapter_slots_total=figures.adapter_slots_total,
            spec_rows=stats.spec_rows,
            hicache_loaded_tokens=stats.hicache_loaded_tokens,
            hicache_written_tokens=stats.hicache_written_tokens,
            hicache_host_pages_used=figures.host_pages_used,
            hicache_host_pages_total=figures.host_pages_total,
            disagg=sched.disagg.figures() if sched.disagg is not None else None,
        )
