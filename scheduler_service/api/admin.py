"""The public API's information and admin RPCs: GetModelInfo, GetServerInfo,
GetLoads, FlushCache, GetTokenizer, SubscribeKvEvents (the servicer hands
them here). It also owns what only they read: the generation throughput
over the core's load snapshots and the KV event publisher."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import grpc
import structlog
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common import tokenizer_archive
from common.settings import flatten
from scheduler_service import ipc
from scheduler_service.api.convert import loads
from scheduler_service.api.core_client import CoreClient, CoreUnavailable
from scheduler_service.api.kv_publisher import KvEventPublisher
from scheduler_service.api.model_info import ModelContext
from scheduler_service.api.throughput import Throughput

VERSION = "radixserve-0.1.0"
TOKENIZER_CHUNK = 64 << 10

logger = structlog.get_logger(__name__)


def _json_value(v: object) -> object:
    """A Struct value: an unset option is null (not the string "None"), a
    sequence a list; what JSON cannot hold (paths, enums) its string."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, frozenset, set)):
        return [_json_value(x) for x in v]
    return str(v)


def _struct(values: dict) -> Struct:
    s = Struct()
    s.update({k: _json_value(v) for k, v in values.items()})
    return s


class AdminRpcs:
    def __init__(self, core: CoreClient, model: ModelContext) -> None:
        self.core = core
        self.model = model
        self.started = time.time()
        self.throughput = Throughput()
        core.on_load(self.throughput.observe)
        self.publisher = KvEventPublisher(core, self._full_load)

    def model_info(self) -> pb.GetModelInfoResponse:
        m, r = self.model, self.model.ready
        eos = list(r.eos_token_ids)
        return pb.GetModelInfoResponse(
            model_path=r.model_name,
            tokenizer_path=m.tokenizer_dir,
            # A sequence classifier scores (Embed, rerank), never generates.
            is_generation=m.scoring is None,
            served_model_name=m.served_model_name,
            weight_version=self.core.config.api.weight_version,
            max_context_length=m.limits.context_len,
            vocab_size=r.vocab_size,
            supports_vision=False,
            model_type=r.architecture.removesuffix("ForCausalLM")
            .removesuffix("ForSequenceClassification")
            .lower(),
            eos_token_ids=eos,
            # 0 where the model declares none, as SGLang's servicer
            pad_token_id=r.pad_token_id or 0,
            bos_token_id=r.bos_token_id or 0,
            max_req_input_len=m.limits.context_len - 1,
            architectures=[r.architecture],
            # A classifier's labels, as SGLang's servicer reports config.json's
            # (0 and "" for a causal LM: the proto's "0 if not a classifier").
            num_labels=m.scoring.num_labels if m.scoring else 0,
            id2label_json=(json.dumps(dict(enumerate(m.scoring.labels))) if m.scoring else ""),
            default_sampling_params_json=(
                json.dumps(m.declared_defaults, separators=(",", ":"))
                if m.declared_defaults
                else ""
            ),
        )

    def server_info(self) -> pb.GetServerInfoResponse:
        r, cfg = self.model.ready, self.core.config
        reasoning = self.model.limits.reasoning_end_token is not None
        args = flatten(cfg)
        args |= {
            "model_path": r.model_name,
            "served_model_name": self.model.served_model_name,
            "tp_size": r.tp_size,
            "dp_size": 1,
            "page_size": r.page_size,
            # Where a require_reasoning request's grammar starts (the gateway
            # shapes a forced tool call's grammar by it): after </think>.
            "constrained_decoding_start": "after_reasoning" if reasoning else "first_token",
        }
        # The backend the sampling worker constrains with, under SGLang's key
        # (the gateway refuses constraints a "none" backend cannot enforce);
        # left out when the worker does not say, as SGLang's servicer does.
        if r.grammar_backend:
            args["grammar_backend"] = r.grammar_backend
        start = Timestamp(seconds=int(self.started))
        load = self.core.load
        return pb.GetServerInfoResponse(
            server_args=_struct(args),
            scheduler_info=_struct(
                {
                    "num_pages": r.num_pages,
                    "page_size": r.page_size,
                    "max_total_num_tokens": r.num_pages * r.page_size,
                    "worker_steps": load.steps if load else 0,
                    "worker_busy_ms": load.worker_busy_ms if load else 0.0,
                    "worker_idle_ms": load.worker_idle_ms if load else 0.0,
                    "core_cpu_s": load.core_cpu_s if load else 0.0,
                    # leak checks: API-process samples with no output yet, and
                    # requests the core holds any state for (both 0 when idle)
                    "queued_requests": self.core.queued,
                    "core_requests": load.tracked if load else 0,
                }
            ),
            active_requests=self.core.active_requests,
            is_paused=False,
            last_receive_timestamp=time.time(),
            uptime_seconds=time.time() - self.started,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=start,
            max_total_num_tokens=r.num_pages * r.page_size,
        )

    async def loads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        try:
            sections = loads.sections_of(list(request.include))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.HasField("dp_rank") and request.dp_rank != 0:
            # SGLang answers an empty list; a rank that does not exist is more
            # likely a client's mistake than a question.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"dp_rank {request.dp_rank}: this scheduler has one data-parallel rank (0)",
            )
        s = self.scheduler_load(sections)
        return pb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=VERSION,
            dp_rank_count=1,
            loads=[s],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=s.num_running_reqs,
                total_waiting_reqs=s.num_waiting_reqs,
                total_reqs=s.num_total_reqs,
                avg_token_usage=s.token_usage,
                avg_throughput=s.gen_throughput,
                avg_utilization=s.utilization,
            ),
        )

    def scheduler_load(self, sections: set[str]) -> pb.SchedulerLoad:
        return loads.scheduler_load(
            self.core.load, self.model.ready, self.throughput.rate(), sections
        )

    def _full_load(self, load: ipc.Load | None) -> pb.SchedulerLoad:
        rate = self.throughput.rate()
        return loads.scheduler_load(load, self.model.ready, rate, set(loads.SECTIONS))

    async def flush_cache(self, request: cpb.FlushCacheRequest, context) -> cpb.FlushCacheResponse:
        """timeout_s 0: flush now (refused while requests are in flight);
        otherwise wait up to timeout_s for the scheduler to go idle."""
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        try:
            while True:
                result = await self.core.flush()
                if result.success or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.05)
        except CoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        message = "Cache flushed successfully" if result.success else result.message
        return cpb.FlushCacheResponse(success=result.success, message=message)

    async def tokenizer(self, context) -> AsyncIterator[cpb.GetTokenizerChunk]:
        data = self.model.ready.tokenizer_zip
        if not data:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer to serve"
            )
        for piece, digest in tokenizer_archive.chunks(data, TOKENIZER_CHUNK):
            yield cpb.GetTokenizerChunk(data=piece, sha256=digest)

    async def kv_events(
        self, request: cpb.SubscribeKvEventsRequest, context
    ) -> AsyncIterator[cpb.KvEventBatch]:
        if request.start_sequence_number:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                "KV event replay cursors are per subscription; resubscribe with zero and rebuild",
            )
        # A cache-aware router (the SMG gateway) subscribes once per scheduler.
        # The peer is read now: this generator may be closed after its call
        # ended (a cancelled call's generator is finalized later), and
        # grpc.aio's context then points at a freed call: context.peer() there
        # crashed the API process with a segfault in cygrpc.
        peer = context.peer()
        logger.info("KV event subscriber joined", peer=peer)
        try:
            records = request.load_records_before_first_batch
            async for batch in self.publisher.subscribe(records_before_first_batch=records):
                yield batch
        finally:
            logger.info("KV event subscriber left", peer=peer)
