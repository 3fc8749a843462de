"""The worker's gRPC servicer: GetInfo, Execute (plans in, results out),
GetTokenizer, CompileGrammar and LoadAdapter / UnloadAdapter. Thin:
conversion lives in execution/convert.py, execution in
execution/model_runner.py, adapters in lora/."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import structlog

from common import tokenizer_archive
from common.simulated_model import SIMULATED_HIDDEN
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_service.device.context import DeviceFailure, use_device
from worker_service.execution.convert import grammar_from_proto, plan_from_proto, result_to_proto
from worker_service.execution.plan import Result
from worker_service.execution.step_work import StartedStep
from worker_service.lora.peft_config import AdapterError
from worker_service.rpc.call_budget import (
    EVICTED,
    OPEN_TIMEOUT_S,
    REPLACED_GRACE_S,
    UNOPENED_STREAMS,
    UnopenedStreams,
)
from worker_service.rpc.kv_receiver import KvReceiver
from worker_service.rpc.kv_send_order import KvSendOrders
from worker_service.rpc.request_decoding import Undecodable
from worker_service.rpc.session import Session, SessionFence, SessionRefused
from worker_service.sampling.grammar import CompileFailed, CompileTimeout, GrammarError
from worker_service.sampling.grammar_pool import PoolFull
from worker_service.telemetry.metrics import WorkerMetrics
from worker_service.telemetry.step_tracing import StepTracer
from worker_service.worker import Worker

logger = structlog.get_logger(__name__)

# 2: Execute streams open a fenced session; 3: drafted extends (speculative decoding)
PROTOCOL_VERSION = 3
# Exit status of a worker whose GPU context broke: `radixserve serve` (or
# Kubernetes) restarts it, and the scheduler re-prefills what it was running.
EXIT_DEVICE_FAILURE = 70
TOKENIZER_CHUNK = 1 << 20
# An IDLE plan sent while file reads are out is answered once a report is
# ready, or after this long (the scheduler then sends another).
IDLE_REPORT_WAIT_S = 0.005
# GetInfo's stored block hashes: at most this many (2 MiB), so the message
# stays far below gRPC's limits; the scheduler's index is a belief anyway.
MAX_REPORTED_HASHES = 1 << 18


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker: Worker,
        metrics: WorkerMetrics | None = None,
        tracer: StepTracer | None = None,
        exit_process: Callable[[int], None] | None = None,
    ) -> None:
        self.worker = worker
        self._exit_process = exit_process or _exit_now
        self.metrics = metrics
        self.tracer = tracer
        self._lock = threading.Lock()  # one step at a time
        self._stream_gen = 0
        self.sessions = SessionFence()
        # Streams that have not taken the worker over yet (call_budget.py).
        self.unopened = UnopenedStreams(UNOPENED_STREAMS)
        # The session that holds the worker: a session that takes over ends it.
        self._active: _SessionStream | None = None
        self._tokenizer_zip: bytes | None = None
        pool = lambda: getattr(worker.runner.compute, "kv", None)  # noqa: E731
        self._kv_receiver = KvReceiver(pool)
        self._kv_sends = KvSendOrders(pool, worker.config.worker_token_file)

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.WorkerInfo:
        w = self.worker
        model = pb.ModelInfo(name=w.model_name, vocab_size=w.vocab_size, dtype=str(w.dtype)[6:])
        mc = w.model_config
        if mc is not None:
            model.architecture = mc.architecture
            model.num_layers = mc.num_layers
            model.num_heads = mc.num_heads
            model.num_kv_heads = mc.num_kv_heads
            model.head_dim = mc.head_dim
            model.hidden_size = mc.hidden_size
            model.eos_token_ids.extend(mc.eos_token_ids)
            model.max_context_len = mc.max_position_embeddings
            if mc.bos_token_id is not None:
                model.bos_token_id = mc.bos_token_id
            if mc.pad_token_id is not None:
                model.pad_token_id = mc.pad_token_id
            for name, value in asdict(mc.sampling_defaults).items():
                if value is not None:
                    setattr(model.sampling_defaults, name, value)
            if mc.score_head is not None:
                model.num_labels = mc.score_head.num_labels
                model.labels.extend(mc.score_head.labels)
                model.score_activation = mc.score_head.activation
        else:
            model.architecture = "simulated"
            model.max_context_len = 1 << 20
            model.hidden_size = SIMULATED_HIDDEN
        model.pooling = pb.POOLING_MEAN if w.pooling.pooling == "mean" else pb.POOLING_LAST
        model.normalize = w.pooling.normalize
        return pb.WorkerInfo(
            protocol_version=PROTOCOL_VERSION,
            model=model,
            page_size=w.config.page_size,
            num_pages=w.num_pages,
            num_swa_pages=w.num_swa_pages,
            swa_window=w.swa_window,
            num_host_pages=w.num_host_pages,
            num_storage_pages=w.num_storage_pages,
            stored_block_hashes=_stored_hashes(w),
            tp_rank=w.tp.rank,
            tp_size=w.tp.size,
            attention_backend=w.attention_backend,
            device=str(w.device),
            session_epoch=self.sessions.highest_epoch,
            weight_bytes=w.weight_bytes,
            kv_cache_bytes=w.kv_cache_bytes,
            graph_bytes=w.graph_bytes,
            grammar_backend=w.grammar_backend,
            kv_shared_memory=getattr(getattr(w.runner.compute, "kv", None), "shared_path", ""),
        )

    def Execute(
        self, request_iterator: Iterator[pb.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResult]:
        """Three stages, each on its own thread: reading plans off the stream
        (a plan sent ahead is read while the step before it runs), executing
        them back to back, and sending results (gRPC blocks the sender until
        a result is written, which must never delay the next step).

        The first message must open a session (session.py): until it has, the
        active session and the worker's state are untouched."""
        peer = context.peer()
        plans: queue.SimpleQueue = queue.SimpleQueue()
        stream = _SessionStream(queue.SimpleQueue(), context, peer)
        try:
            session, gen, opening = self._open(request_iterator, plans, stream)
        except SessionRefused as e:
            logger.warning("Execute stream refused", peer=peer, code=e.code.name, reason=e.message)
            if self.metrics is not None:
                self.metrics.refused("Execute", e.code.name)
            context.abort(e.code, e.message)
        logger.info(
            "scheduler session opened",
            peer=peer,
            session_id=session.session_id,
            epoch=session.epoch,
        )
        if self.metrics is not None:
            self.metrics.streams += 1
        results = stream.results
        threading.Thread(target=self._run_plans, args=(plans, gen, results), daemon=True).start()
        try:
            yield pb.StepResult(step_id=opening.step_id)  # the session is open
            while (item := results.get()) is not None:
                if isinstance(item, str):
                    context.abort(grpc.StatusCode.ABORTED, item)
                yield item
        finally:
            stream.ended.set()
            if self.metrics is not None:
                self.metrics.streams -= 1
        logger.info("scheduler stream closed", peer=peer, session_id=session.session_id)

    def _open(
        self,
        request_iterator: Iterator[pb.StepPlan],
        plans: queue.SimpleQueue,
        stream: _SessionStream,
    ) -> tuple[Session, int, pb.StepPlan]:
        """Wait for the stream's opening and take the worker over with it, or
        raise SessionRefused. Until the stream it replaced has ended, the
        stream counts among the unopened ones, whose number is bounded: a
        stream that never opens holds a gRPC thread for OPEN_TIMEOUT_S, or
        until a newer stream takes its place."""
        place = self.unopened.enter(plans)
        if place is None:
            raise SessionRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, self.unopened.refusal())
        try:
            threading.Thread(
                target=_read_plans, args=(request_iterator, plans), daemon=True
            ).start()
            try:
                opening = plans.get(timeout=OPEN_TIMEOUT_S)
            except queue.Empty:
                raise SessionRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"no opening message within {OPEN_TIMEOUT_S:g} s",
                ) from None
            if opening is EVICTED or not self.unopened.opened(place):
                raise SessionRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, self.unopened.eviction())
            self.sessions.check(opening)  # refuse without waiting for the lock
            with self._lock:
                session = self.sessions.take(opening, stream.peer)
                self._stream_gen += 1
                gen = self._stream_gen
                self.worker.runner.reset()
                if self.tracer is not None:
                    self.tracer.reset()
                replaced, self._active = self._active, stream
            if replaced is not None:
                _end_replaced(replaced, session)
            return session, gen, opening
        finally:
            self.unopened.leave(place)

    def _run_plans(self, plans: queue.SimpleQueue, gen: int, results: queue.SimpleQueue) -> None:
        """Execute the stream's plans in order. With an overlapping runner the
        next plan, when it is already here, is started before the running
        step's tokens are waited for, so the GPU finds it queued."""
        # Streams, events and the token download belong to the current GPU of
        # this thread: make it the worker's, whatever cuda:N that is.
        use_device(self.worker.device)
        clock = _StepClock()
        overlap = self.worker.runner.overlap
        running: _Running | None = None
        while True:
            if running is None:
                msg = clock.waiting(plans.get)
            else:
                try:
                    msg = plans.get_nowait()
                except queue.Empty:
                    msg = _NOTHING_YET
            with self._lock:
                if gen != self._stream_gen:
                    results.put("replaced by a newer Execute stream")
                    return
                if isinstance(msg, Undecodable):
                    results.put(f"a plan on the stream: {msg.details()}")
                    return
                try:
                    if msg is _NOTHING_YET:  # nothing to overlap with: finish it
                        results.put(self._complete(running, clock))
                        running = None
                        continue
                    started = None if msg is None else self._start(msg)
                    if running is not None:
                        results.put(self._complete(running, clock))
                    running = started
                    if running is not None and not overlap:
                        results.put(self._complete(running, clock))
                        running = None
                except DeviceFailure as e:
                    # Every later step would fail too: end the process so that
                    # it is restarted (the scheduler sees a lost worker, keeps
                    # its requests and re-prefills them on the new one).
                    logger.critical("the GPU context is broken; exiting", error=str(e))
                    self._exit_process(EXIT_DEVICE_FAILURE)
                    return
            if msg is None:
                results.put(None)
                return

    def _start(self, msg: pb.StepPlan) -> _Running:
        start_ns = time.time_ns() if self.tracer is not None else 0
        try:
            plan = plan_from_proto(msg)
        except ValueError as e:
            error = Result(msg.step_id, error=f"malformed plan: {e}")
            return _Running(msg, step=None, error=error, start_ns=start_ns)
        step = self.worker.runner.start(plan)
        return _Running(msg, step=step, error=None, start_ns=start_ns)

    def _complete(self, running: _Running, clock: _StepClock) -> pb.StepResult:
        """The step's result message; forward_ms is this thread's time since the
        previous result that was not spent waiting for plans."""
        done = running.error or self.worker.runner.complete(running.step)
        files = self.worker.runner.files
        if files is not None:  # the file reads finished meanwhile
            msg = running.msg
            if msg.mode == pb.FORWARD_MODE_IDLE and not (msg.extends or msg.decode_slots):
                files.wait_done(IDLE_REPORT_WAIT_S)  # sent to collect reads: no spin
            done.storage_done.extend(files.take_done())
        result = result_to_proto(done)
        busy_s, idle_s = clock.result_ready()
        result.forward_ms = busy_s * 1e3
        result.idle_ms = idle_s * 1e3
        if self.metrics is not None:
            self.metrics.step(running.msg, busy_s, idle_s, applied=not result.error)
        if self.tracer is not None and not result.error:
            self.tracer.step(running.msg, running.start_ns, time.time_ns(), result.forward_ms)
        return result

    def CompileGrammar(
        self, request: pb.CompileGrammarRequest, context: grpc.ServicerContext
    ) -> pb.CompileGrammarResponse:
        """Compiled in the compile pool's processes (grammar_pool.py); this gRPC
        thread only waits, within the call's deadline, and loads the result.
        Past the deadline, or when the caller cancels, the compile is killed."""
        grammars = self.worker.runner.grammars
        if grammars is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "structured generation needs the sampling rank (0) of a model with a tokenizer",
            )
        try:
            kind, text = grammar_from_proto(request.grammar)
            ms = grammars.compile_in_pool(
                kind, text, context.time_remaining(), on_cancel=_on_end(context)
            )
        except (GrammarError, ValueError) as e:
            return pb.CompileGrammarResponse(error=str(e))
        except PoolFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except CompileTimeout as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except CompileFailed as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        return pb.CompileGrammarResponse(compile_ms=ms)

    def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.LoadAdapterResponse:
        """Runs on a gRPC thread and never takes the step lock: the files are
        read and sharded while steps go on, then published in one dict write."""
        if not request.name:
            return pb.LoadAdapterResponse(error="an adapter needs a name")
        t0 = time.perf_counter()
        use_device(self.worker.device)
        try:
            adapter = self.worker.adapter_loader.load(
                request.name, Path(request.path), request.max_rank
            )
        except AdapterError as e:
            logger.warning("adapter refused", name=request.name, path=request.path, error=str(e))
            return pb.LoadAdapterResponse(error=f"adapter {request.name!r}: {e}")
        self.worker.runner.adapters.put(adapter)
        ms = (time.perf_counter() - t0) * 1e3
        logger.info("adapter ready", name=request.name, rank=adapter.rank, load_ms=round(ms, 1))
        return pb.LoadAdapterResponse(
            rank=adapter.rank, target_modules=list(adapter.target_modules), load_ms=ms
        )

    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        """Forgets the name; slots and requests holding the adapter keep it."""
        return pb.UnloadAdapterResponse(found=self.worker.runner.adapters.remove(request.name))

    def PushKv(
        self, request_iterator: Iterator[pb.KvBatch], context: grpc.ServicerContext
    ) -> Iterator[pb.KvAck]:
        """Another worker's KV pages into this pool (kv_receiver.py)."""
        return self._kv_receiver.push(request_iterator, context)

    def SendKv(self, request: pb.SendKvRequest, context: grpc.ServicerContext) -> pb.SendKvResponse:
        """Push pages of this pool into another worker's (kv_send_order.py)."""
        return self._kv_sends.send(request, context)

    def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TokenizerChunk]:
        try:
            data = self._tokenizer_archive()
        except LookupError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        for piece, digest in tokenizer_archive.chunks(data, TOKENIZER_CHUNK):
            yield pb.TokenizerChunk(data=piece, sha256=digest)

    def _tokenizer_archive(self) -> bytes:
        if self._tokenizer_zip is None:
            self._tokenizer_zip = tokenizer_archive.pack(self.worker.tokenizer_files())
        return self._tokenizer_zip


_NOTHING_YET = object()  # no plan waiting behind the running step


@dataclass
class _SessionStream:
    """An Execute stream that holds (or held) the worker: its results go out
    from the RPC's thread, which sets ``ended`` when the call is over."""

    results: queue.SimpleQueue
    context: grpc.ServicerContext
    peer: str
    ended: threading.Event = field(default_factory=threading.Event)


def _end_replaced(replaced: _SessionStream, by: Session) -> None:
    """Tell the replaced stream it is over; cancel it if it has not ended in
    REPLACED_GRACE_S, which means its caller does not read its results and its
    thread is stuck sending one (only a cancel frees that thread)."""
    replaced.results.put(f"replaced by scheduler session {by.session_id} (epoch {by.epoch})")
    if not replaced.ended.wait(REPLACED_GRACE_S):
        logger.warning(
            "replaced Execute stream does not read its results: cancelled",
            peer=replaced.peer,
            grace_s=REPLACED_GRACE_S,
        )
        replaced.context.cancel()


@dataclass
class _Running:
    msg: pb.StepPlan
    step: StartedStep | None
    error: Result | None  # a plan refused before it could start
    start_ns: int


class _StepClock:
    """Splits the executing thread's time into busy (between results, not
    waiting for a plan) and idle (waiting for a plan), per result."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self._idle = 0.0

    def waiting(self, get: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        item = get()
        now = time.perf_counter()
        self._idle += now - t0
        self._mark += now - t0  # waiting is not part of the next step's busy time
        return item

    def result_ready(self) -> tuple[float, float]:
        now = time.perf_counter()
        busy, idle = now - self._mark, self._idle
        self._mark, self._idle = now, 0.0
        return busy, idle


def _on_end(context: grpc.ServicerContext) -> Callable[[Callable[[], None]], object]:
    """Registers a callback for the end of the call (a cancelled one included);
    one that ended already runs it at once."""

    def register(callback: Callable[[], None]) -> object:
        if not context.add_callback(callback):
            callback()
        return None

    return register


def _exit_now(status: int) -> None:
    """Leave at once (no interpreter teardown: CUDA calls in it could hang),
    with what was logged flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _read_plans(stream: Iterator[pb.StepPlan], plans: queue.SimpleQueue) -> None:
    try:
        for msg in stream:
            plans.put(msg)
    except grpc.RpcError:
        pass  # the scheduler went away: the stream is over
    finally:
        plans.put(None)


def _stored_hashes(w: Worker) -> list[int]:
    """The block hashes the file tier's folder holds now (none without one),
    at most MAX_REPORTED_HASHES of them (8 bytes each on the wire)."""
    files = w.runner.files
    if files is None:
        return []
    return files.store.stored_hashes()[:MAX_REPORTED_HASHES].tolist()
