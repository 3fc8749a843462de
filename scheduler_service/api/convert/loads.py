"""The core's load snapshot -> GetLoads' SchedulerLoad and the KV-event
stream's EngineLoad, with SGLang's field meanings (its scheduler's
get_loads, its servicer's loads.py and load_record.py): the core figures
always, the sections asked for; the event stream's record is the same
figures, so the gateway sees one worker alike whether it polls or listens.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.core.disagg.orders import DisaggFigures

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues")
GIB = float(1 << 30)


def sections_of(include: list[str]) -> set[str]:
    """The sections an ``include`` list asks for (empty: all, as SGLang's
    servicer reads it); ValueError naming the unknown ones."""
    asked = set(include) or {"all"}
    bad = sorted(asked - {*SECTIONS, "all"})
    if bad:
        raise ValueError(f"Invalid include sections: {bad}. Valid options: {[*SECTIONS, 'all']}")
    return set(SECTIONS) if "all" in asked else asked


def scheduler_load(
    load: ipc.Load | None, ready: ipc.Ready, rate: float, sections: set[str]
) -> pb.SchedulerLoad:
    """Rank 0's load (the only data-parallel rank) with the ``sections``;
    before the core's first snapshot every count is 0."""
    total = ready.num_pages * ready.page_size
    load = load or _no_load(total)
    running, waiting = load.running, load.waiting
    s = pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        num_used_tokens=load.used_tokens,
        max_total_num_tokens=total,
        token_usage=round(load.used_tokens / max(total, 1), 4),
        gen_throughput=round(rate, 2),
        cache_hit_rate=round(load.cache_hit_rate, 4),
        utilization=round(running / max(load.max_running_requests, 1), 4),
        max_running_requests=load.max_running_requests,
        num_waiting_uncached_tokens=load.waiting_uncached_tokens,
    )
    if "memory" in sections:
        s.memory.CopyFrom(
            pb.MemoryMetrics(
                weight_gb=round(ready.weight_bytes / GIB, 3),
                kv_cache_gb=round(ready.kv_cache_bytes / GIB, 3),
                graph_gb=round(ready.graph_bytes / GIB, 3),
                token_capacity=total,
            )
        )
    # As SGLang: only once speculation has verified drafts. The acceptance
    # length counts the token each verified row samples after its drafts.
    if "spec" in sections and load.spec_rows:
        s.speculative.CopyFrom(
            pb.SpeculativeMetrics(
                accept_length=round(1 + load.spec_accepted_tokens / load.spec_rows, 4),
                accept_rate=round(load.spec_accepted_tokens / max(load.spec_draft_tokens, 1), 4),
            )
        )
    if "lora" in sections and load.adapter_slots_total:
        used, slots = load.adapter_slots_used, load.adapter_slots_total
        s.lora.CopyFrom(
            pb.LoRAMetrics(slots_used=used, slots_total=slots, utilization=round(used / slots, 4))
        )
    if "disagg" in sections:
        s.disaggregation.CopyFrom(disaggregation_metrics(load.disagg))
    if "queues" in sections:
        # No grammar queue (grammars compile before the core sees a request)
        # and no pause (radixserve has no pause_generation).
        s.queues.CopyFrom(pb.QueueMetrics(waiting=waiting, retracted=load.retracted_waiting))
    return s


def disaggregation_metrics(f: DisaggFigures | None) -> pb.DisaggregationMetrics:
    """SGLang's queue counts by role; mode "null" (and nothing else) for a
    unit that serves alone. No transfer speed or latency yet (0)."""
    if f is None:
        return pb.DisaggregationMetrics(mode="null")
    return pb.DisaggregationMetrics(
        mode=f.mode,
        prefill_prealloc_queue_reqs=f.bootstrapping,
        prefill_inflight_queue_reqs=f.sending,
        decode_prealloc_queue_reqs=f.prealloc,
        decode_transfer_queue_reqs=f.receiving,
    )


def _no_load(total: int) -> ipc.Load:
    return ipc.Load(
        running=0,
        waiting=0,
        used_tokens=0,
        total_tokens=total,
        cache_hit_rate=0.0,
        gen_tokens=0,
        steps=0,
        worker_busy_ms=0.0,
        worker_idle_ms=0.0,
        core_cpu_s=0.0,
        max_running_requests=0,
    )


def engine_load(
    s: pb.SchedulerLoad, sample: int, *, load_only: bool, telemetry: bool
) -> cpb.EngineLoad:
    """The KV-event stream's record of ``s`` (SGLang's servicer's
    engine_load_from): the routing core always; ``telemetry`` (the cache hit
    rate, the token counts, the sections) on heartbeats and a stream's first
    record only, as the proto asks."""
    record = cpb.EngineLoad(
        running_requests=s.num_running_reqs,
        waiting_requests=s.num_waiting_reqs,
        waiting_uncached_tokens=max(s.num_waiting_uncached_tokens, 0),
        token_usage=s.token_usage,
        gen_throughput=s.gen_throughput,
        max_running_requests=s.max_running_requests,
        sample=sample,
        load_only=load_only,
    )
    if telemetry:
        record.cache_hit_rate = s.cache_hit_rate
        record.num_used_tokens = s.num_used_tokens
        record.max_total_num_tokens = s.max_total_num_tokens
        for name in ("memory", "queues", "speculative", "lora", "disaggregation"):
            if s.HasField(name):
                section = getattr(s, name)
                target = getattr(record, name)
                for f in target.DESCRIPTOR.fields:
                    setattr(target, f.name, getattr(section, f.name))
    return record
