"""Protocol messages <-> the worker's dataclasses: the one module that knows both."""

from __future__ import annotations

import numpy as np

from protos import worker_pb2 as pb
from worker_service.execution.plan import (
    AdapterSlot,
    Extend,
    ForwardMode,
    Join,
    PageCopies,
    Plan,
    Result,
    StorageCopies,
)
from worker_service.sampling.params import LogprobOptions, SamplingParams

_POOLINGS = {pb.POOLING_NONE: "", pb.POOLING_LAST: "last", pb.POOLING_MEAN: "mean"}

_MODES = {
    pb.FORWARD_MODE_PREFILL: ForwardMode.PREFILL,
    pb.FORWARD_MODE_DECODE: ForwardMode.DECODE,
    pb.FORWARD_MODE_MIXED: ForwardMode.MIXED,
    pb.FORWARD_MODE_IDLE: ForwardMode.IDLE,
    pb.FORWARD_MODE_UNSPECIFIED: ForwardMode.IDLE,
}


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
        repetition_penalty=m.repetition_penalty,
        min_new_tokens=m.min_new_tokens,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logit_bias=tuple(zip(m.logit_bias_ids, m.logit_bias_values, strict=True)),
        seed=m.seed if m.HasField("seed") else None,
        grammar=grammar_from_proto(m.grammar) if m.grammar.kind else None,
        reasoning_end_token=m.reasoning_end_token - 1 if m.reasoning_end_token else None,
    )


_GRAMMAR_KINDS = {
    pb.GRAMMAR_KIND_REGEX: "regex",
    pb.GRAMMAR_KIND_JSON_SCHEMA: "json_schema",
    pb.GRAMMAR_KIND_EBNF: "ebnf",
    pb.GRAMMAR_KIND_STRUCTURAL_TAG: "structural_tag",
}


def grammar_from_proto(m: pb.Grammar) -> tuple[str, str]:
    if m.kind not in _GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {m.kind}")
    return _GRAMMAR_KINDS[m.kind], m.text


def logprobs_from_proto(m: pb.LogprobOptions) -> LogprobOptions:
    return LogprobOptions(
        return_logprob=m.return_logprob,
        logprob_start_len=m.logprob_start_len,
        top_logprobs_num=m.top_logprobs_num,
        token_ids_logprob=tuple(m.token_ids_logprob),
    )


def _pooling_from_proto(value: int) -> str:
    if value not in _POOLINGS:
        raise ValueError(f"unknown pooling {value}")
    return _POOLINGS[value]


def plan_from_proto(m: pb.StepPlan) -> Plan:
    return Plan(
        step_id=m.step_id,
        mode=_MODES.get(m.mode, ForwardMode.IDLE),
        leaves=list(m.leaves),
        joins=[
            Join(
                slot=j.slot,
                rid=j.rid,
                sampling=sampling_from_proto(j.sampling),
                logprobs=logprobs_from_proto(j.logprobs),
                prompt_len=j.prompt_len,
                prefix_ids=list(j.prefix_ids),
                num_output_tokens=j.num_output_tokens,
                traceparent=j.trace.traceparent,
                tracestate=j.trace.tracestate,
                adapter_slot=j.adapter_slot,
                pooling=_pooling_from_proto(j.pooling),
                normalize=j.normalize,
                last_token=j.last_token if j.HasField("last_token") else None,
                kv_pages=list(j.kv_pages),
            )
            for j in m.joins
        ],
        extends=[
            Extend(
                slot=e.slot,
                start_pos=e.start_pos,
                input_ids=list(e.input_ids),
                new_pages=list(e.new_pages),
                sample=e.sample,
                next_token=e.next_token if e.HasField("next_token") else None,
                draft_len=e.draft_len,
                new_swa_pages=list(e.new_swa_pages),
            )
            for e in m.extends
        ],
        decode_slots=list(m.decode_slots),
        decode_positions=list(m.decode_positions),
        decode_new_pages=list(m.decode_new_pages),
        decode_new_swa_pages=list(m.decode_new_swa_pages),
        adapter_slots=[AdapterSlot(a.slot, a.name) for a in m.adapter_slots],
        copies=_copies_from_proto(m),
        storage=_storage_from_proto(m),
    )


def _copies_from_proto(m: pb.StepPlan) -> PageCopies | None:
    """The host tier's columns (validation checks their lengths and ranges);
    None when the plan has none."""
    if not (m.write_back_device_pages or m.write_back_host_pages) and not (
        m.load_host_pages or m.load_device_pages
    ):
        return None
    return PageCopies(
        write_back_device=np.array(m.write_back_device_pages, dtype=np.int64),
        write_back_host=np.array(m.write_back_host_pages, dtype=np.int64),
        load_host=np.array(m.load_host_pages, dtype=np.int64),
        load_device=np.array(m.load_device_pages, dtype=np.int64),
    )


def _storage_from_proto(m: pb.StepPlan) -> StorageCopies | None:
    """The file tier's columns (validation checks them); None when none."""
    if not (m.storage_write_hashes or m.storage_write_host_pages) and not (
        m.storage_read_hashes or m.storage_read_host_pages
    ):
        return None
    return StorageCopies(
        write_hashes=np.array(m.storage_write_hashes, dtype=np.int64),
        write_host=np.array(m.storage_write_host_pages, dtype=np.int64),
        read_hashes=np.array(m.storage_read_hashes, dtype=np.int64),
        read_host=np.array(m.storage_read_host_pages, dtype=np.int64),
    )


def result_to_proto(r: Result) -> pb.StepResult:
    return pb.StepResult(
        step_id=r.step_id,
        error=r.error,
        slots=r.slots,
        token_ids=r.token_ids,
        logprobs=r.logprobs,
        top_counts=r.top_counts,
        top_ids=r.top_ids,
        top_logprobs=r.top_logprobs,
        ids_counts=r.ids_counts,
        ids_logprobs=r.ids_logprobs,
        prompt_logprobs=[
            pb.PromptLogprobs(
                slot=p.slot,
                start=p.start,
                logprobs=p.logprobs,
                top_ids=p.top_ids,
                top_logprobs=p.top_logprobs,
                ids_logprobs=p.ids_logprobs,
            )
            for p in r.prompt_logprobs
        ],
        forward_ms=r.forward_ms,
        idle_ms=r.idle_ms,
        grammar_ended=r.grammar_ended,
        token_counts=r.token_counts,
        embeddings=[pb.Embedding(slot=e.slot, values=e.values) for e in r.embeddings],
        storage_done=[
            pb.StorageReadsDone(step_id=d.step_id, failed=d.failed) for d in r.storage_done
        ],
    )
