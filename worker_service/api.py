"""The worker's gRPC servicer: GetInfo, Execute (plans in, results out) and
GetTokenizer. Thin: conversion lives in convert.py, execution in executor.py."""

from __future__ import annotations

import hashlib
import io
import threading
import time
import zipfile
from collections.abc import Iterator

import grpc
import structlog

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from worker_service.convert import plan_from_proto, result_to_proto
from worker_service.engine import Worker

logger = structlog.get_logger(__name__)

PROTOCOL_VERSION = 1
TOKENIZER_CHUNK = 1 << 20


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._lock = threading.Lock()  # one step at a time
        self._stream_gen = 0
        self._tokenizer_zip: bytes | None = None

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
        else:
            model.architecture = "simulated"
            model.max_context_len = 1 << 20
        return pb.WorkerInfo(
            protocol_version=PROTOCOL_VERSION,
            model=model,
            page_size=w.config.page_size,
            num_pages=w.num_pages,
            tp_rank=w.tp.rank,
            tp_size=w.tp.size,
            attention_backend=w.attention_backend,
            device=str(w.device),
        )

    def Execute(
        self, request_iterator: Iterator[pb.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResult]:
        with self._lock:
            self._stream_gen += 1
            gen = self._stream_gen
            self.worker.executor.reset()
        logger.info("scheduler stream opened", peer=context.peer())
        waited_since = time.perf_counter()
        for msg in request_iterator:
            idle_ms = (time.perf_counter() - waited_since) * 1e3
            with self._lock:
                if gen != self._stream_gen:
                    context.abort(grpc.StatusCode.ABORTED, "replaced by a newer Execute stream")
                try:
                    plan = plan_from_proto(msg)
                except ValueError as e:
                    result = pb.StepResult(step_id=msg.step_id, error=f"malformed plan: {e}")
                else:
                    out = self.worker.executor.execute(plan)
                    out.idle_ms = idle_ms
                    result = result_to_proto(out)
            yield result
            waited_since = time.perf_counter()
        logger.info("scheduler stream closed", peer=context.peer())

    def GetTokenizer(
        self, request: pb.GetTokenizerRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TokenizerChunk]:
        try:
            data = self._tokenizer_archive()
        except LookupError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK):
            last = start + TOKENIZER_CHUNK >= len(data)
            yield pb.TokenizerChunk(
                data=data[start : start + TOKENIZER_CHUNK], sha256=digest if last else ""
            )

    def _tokenizer_archive(self) -> bytes:
        if self._tokenizer_zip is None:
            files = self.worker.tokenizer_files()
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
                for name in sorted(files):
                    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
                    zf.writestr(info, files[name], zipfile.ZIP_DEFLATED)
            self._tokenizer_zip = buf.getvalue()
        return self._tokenizer_zip
