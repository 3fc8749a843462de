"""Core step plans -> radixserve.worker.v1 messages, and results back.

Requests are named by small integer slots on the wire. A slot freed by a
leave can be reused by a join of the same plan (the worker applies leaves
first), so results are decoded against the plan they answer (the
scheduler's record of it, ``Scheduler.in_flight()``: its entries in wire
order, each with the slot it was sent under), never against the current
slot map. The codec keeps nothing per plan.
"""

from __future__ import annotations

import heapq
import math
from array import array

from protos import worker_pb2 as pb
from scheduler_service.core.ids import ID_TYPE, StorageReadsDone
from scheduler_service.core.plan import (
    ForwardMode,
    Join,
    PlanEntry,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from scheduler_service.core.sampling import LogprobOptions, SamplingParams
from scheduler_service.grammar_proto import grammar_to_proto

_POOLINGS = {"last": pb.POOLING_LAST, "mean": pb.POOLING_MEAN}

_MODES = {
    ForwardMode.PREFILL: pb.FORWARD_MODE_PREFILL,
    ForwardMode.DECODE: pb.FORWARD_MODE_DECODE,
    ForwardMode.MIXED: pb.FORWARD_MODE_MIXED,
    ForwardMode.IDLE: pb.FORWARD_MODE_IDLE,
}


class WorkerProtocolError(RuntimeError):
    """A worker answered something that does not fit the plan it was sent."""


def sampling_to_proto(sp: SamplingParams, m: pb.SamplingParams) -> None:
    m.temperature = sp.temperature
    m.top_p = sp.top_p
    m.top_k = sp.top_k
    m.min_p = sp.min_p
    m.frequency_penalty = sp.frequency_penalty
    m.presence_penalty = sp.presence_penalty
    m.repetition_penalty = sp.repetition_penalty
    m.min_new_tokens = sp.min_new_tokens
    m.stop_token_ids.extend(sorted(sp.stop_token_ids))
    m.ignore_eos = sp.ignore_eos
    for token, bias in sp.logit_bias:
        m.logit_bias_ids.append(token)
        m.logit_bias_values.append(bias)
    if sp.seed is not None:
        m.seed = sp.seed
    if sp.grammar is not None:
        grammar_to_proto(sp.grammar, m.grammar)
        if sp.reasoning_end_token is not None:  # the worker needs it only to defer a grammar
            m.reasoning_end_token = sp.reasoning_end_token + 1


def logprobs_to_proto(lp: LogprobOptions, m: pb.LogprobOptions) -> None:
    m.return_logprob = lp.return_logprob
    m.logprob_start_len = lp.logprob_start_len
    m.top_logprobs_num = lp.top_logprobs_num
    m.token_ids_logprob.extend(lp.token_ids_logprob)


class WorkerCodec:
    def __init__(self, *, sliding: bool = False) -> None:
        """``sliding``: the worker has a sliding pool (WorkerInfo.num_swa_pages),
        so plans carry sliding pages beside the full ones."""
        self.sliding = sliding
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._next_slot = 0

    def forget_worker(self) -> None:
        """The worker group was lost: its slots are gone (the requests rejoin
        the new group)."""
        self._slots.clear()
        self._free.clear()
        self._next_slot = 0

    def _take_slot(self, rid: str) -> int:
        slot = heapq.heappop(self._free) if self._free else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        self._slots[rid] = slot
        return slot

    def encode(self, plan: StepPlan) -> pb.StepPlan:
        """The plan's message; each entry learns the slot it is sent under."""
        msg = pb.StepPlan(step_id=plan.step_id, mode=_MODES[plan.mode])
        slots = self._slots
        for rid in plan.leaves:
            slot = slots.pop(rid)
            heapq.heappush(self._free, slot)
            msg.leaves.append(slot)
        for slot, lora_id in plan.adapter_slots:
            msg.adapter_slots.add(slot=slot, name=lora_id)
        for join in plan.joins:
            self._join(join, msg.joins.add())
        for e in plan.extends:
            e.slot = slot = slots[e.req.rid]
            ext = msg.extends.add(
                slot=slot,
                start_pos=e.start_pos,
                input_ids=e.input_ids,
                new_pages=e.new_pages,
                sample=e.sample,
                draft_len=e.draft_len,
                new_swa_pages=e.new_swa_pages,
            )
            if e.next_token is not None:
                ext.next_token = e.next_token
        decodes = plan.decodes
        if decodes:
            decode_slots = []
            for e in decodes:
                e.slot = slot = slots[e.req.rid]
                decode_slots.append(slot)
            msg.decode_slots.extend(decode_slots)
            msg.decode_positions.extend([e.start_pos for e in decodes])
            msg.decode_new_pages.extend([e.new_pages[0] + 1 if e.new_pages else 0 for e in decodes])
            if self.sliding:
                msg.decode_new_swa_pages.extend(
                    [e.new_swa_pages[0] + 1 if e.new_swa_pages else 0 for e in decodes]
                )
        if plan.write_backs is not None:  # the host tier's copies: packed columns as they are
            msg.write_back_device_pages.extend(plan.write_backs.src)
            msg.write_back_host_pages.extend(plan.write_backs.dst)
        if plan.loads is not None:
            msg.load_host_pages.extend(plan.loads.src)
            msg.load_device_pages.extend(plan.loads.dst)
        if plan.storage_writes is not None:  # the file tier's copies, as the host tier's
            msg.storage_write_hashes.extend(plan.storage_writes.hashes)
            msg.storage_write_host_pages.extend(plan.storage_writes.host)
        if plan.storage_reads is not None:
            msg.storage_read_hashes.extend(plan.storage_reads.hashes)
            msg.storage_read_host_pages.extend(plan.storage_reads.host)
        return msg

    def _join(self, join: Join, m: pb.Join) -> None:
        m.slot = self._take_slot(join.rid)
        m.rid = join.rid
        sampling_to_proto(join.sampling, m.sampling)
        logprobs_to_proto(join.logprobs, m.logprobs)
        m.prompt_len = join.prompt_len
        m.prefix_ids.extend(join.prefix_ids)
        m.num_output_tokens = join.num_output_tokens
        m.adapter_slot = join.adapter_slot
        if join.trace_context is not None:
            m.trace.traceparent, m.trace.tracestate = join.trace_context
        if join.last_token is not None:  # a decode unit's landed request (core/disagg/)
            m.last_token = join.last_token
            m.kv_pages.extend(join.kv_pages)
        if join.embed is not None:
            m.pooling = _POOLINGS[join.embed.pooling]
            m.normalize = join.embed.normalize

    def decode(self, msg: pb.StepResult, plan: StepPlan) -> StepResult:
        """``msg`` read against ``plan``, the plan it answers."""
        result = self._decode(msg, plan)
        if msg.storage_done:
            result.storage_done = [
                StorageReadsDone(d.step_id, array(ID_TYPE, d.failed)) for d in msg.storage_done
            ]
        return result

    def _decode(self, msg: pb.StepResult, plan: StepPlan) -> StepResult:
        if msg.step_id != plan.step_id:
            raise WorkerProtocolError(
                f"result for step {msg.step_id}, the oldest plan in flight is {plan.step_id}"
            )
        if msg.error:
            raise WorkerProtocolError(f"the worker refused step {msg.step_id}: {msg.error}")
        sampled = [e for e in plan.extends if e.sample]
        sampled += plan.decodes
        if msg.token_counts or plan.drafted:
            return self._decode_counted(msg, plan, sampled)
        if len(msg.token_ids) != len(sampled):
            raise WorkerProtocolError(
                f"step {msg.step_id}: {len(msg.token_ids)} tokens for {len(sampled)} entries"
            )
        ended = msg.grammar_ended
        if any(i >= len(sampled) for i in ended):
            raise WorkerProtocolError(f"step {msg.step_id}: grammar_ended past the sampled tokens")
        if (
            not msg.prompt_logprobs
            and not msg.embeddings
            and not any(e.req.logprobs.return_logprob for e in sampled)
        ):
            # No logprob payloads (the common decode step): one output per
            # sampling entry, each rid once, so nothing to merge; without a
            # grammar ending, the tokens alone (StepResult.tokens).
            if not ended:
                return StepResult(
                    msg.step_id, [], msg.forward_ms, msg.idle_ms, tokens=list(msg.token_ids)
                )
            rids = [e.req.rid for e in sampled]
            outputs = list(map(RequestOutput, rids, msg.token_ids))
            for i in ended:
                outputs[i].grammar_ended = True
            return StepResult(msg.step_id, outputs, msg.forward_ms, msg.idle_ms)
        outputs: list[RequestOutput] = []
        top_at = ids_at = 0
        tops, idss = msg.top_counts, msg.ids_counts
        for i, (e, token) in enumerate(zip(sampled, msg.token_ids, strict=True)):
            lp = None
            n_top = tops[i] if tops else 0
            n_ids = idss[i] if idss else 0
            opts = e.req.logprobs
            if opts.return_logprob:
                lp = TokenLogprobs(logprob=msg.logprobs[i])
                if n_top:
                    lp.top_ids = list(msg.top_ids[top_at : top_at + n_top])
                    lp.top_logprobs = list(msg.top_logprobs[top_at : top_at + n_top])
                if n_ids:
                    lp.ids = list(opts.token_ids_logprob)
                    lp.ids_logprobs = list(msg.ids_logprobs[ids_at : ids_at + n_ids])
            top_at += n_top
            ids_at += n_ids
            outputs.append(RequestOutput(e.req.rid, token, lp))
        for i in ended:
            outputs[i].grammar_ended = True
        return self._with_prompt_logprobs(msg, plan, outputs)

    def _decode_counted(
        self, msg: pb.StepResult, plan: StepPlan, sampled: list[PlanEntry]
    ) -> StepResult:
        """A result with several tokens per entry (drafted extends): token_ids,
        logprobs, top_counts and ids_counts hold one entry per token, and
        token_counts says how many tokens each sampling entry has."""
        step = msg.step_id
        counts = list(msg.token_counts) or [1] * len(sampled)
        if len(counts) != len(sampled):
            raise WorkerProtocolError(
                f"step {step}: {len(counts)} token counts for {len(sampled)} entries"
            )
        for e, n in zip(sampled, counts, strict=True):
            if not 1 <= n <= e.draft_len + 1:
                raise WorkerProtocolError(
                    f"step {step}: {n} tokens for {e.req.rid} with {e.draft_len} drafts"
                )
        total = sum(counts)
        if len(msg.token_ids) != total:
            raise WorkerProtocolError(
                f"step {step}: {len(msg.token_ids)} tokens, token_counts say {total}"
            )
        tops, idss = msg.top_counts, msg.ids_counts
        for name, arr in (("top_counts", tops), ("ids_counts", idss)):
            if arr and len(arr) != total:
                raise WorkerProtocolError(f"step {step}: {len(arr)} {name} for {total} tokens")
        if any(i >= total for i in msg.grammar_ended):
            raise WorkerProtocolError(f"step {step}: grammar_ended past the sampled tokens")
        wanting = any(e.req.logprobs.return_logprob for e in sampled)
        if wanting and len(msg.logprobs) != total:
            raise WorkerProtocolError(f"step {step}: {len(msg.logprobs)} logprobs, {total} tokens")
        ended = set(msg.grammar_ended)
        outputs: list[RequestOutput] = []
        at = top_at = ids_at = 0
        for e, n in zip(sampled, counts, strict=True):
            opts = e.req.logprobs if e.req.logprobs.return_logprob else None
            lps: list[TokenLogprobs | None] = []
            for i in range(at, at + n):
                n_top = tops[i] if tops else 0
                n_ids = idss[i] if idss else 0
                lp = None
                if opts is not None:
                    lp = TokenLogprobs(logprob=msg.logprobs[i])
                    if n_top:
                        lp.top_ids = list(msg.top_ids[top_at : top_at + n_top])
                        lp.top_logprobs = list(msg.top_logprobs[top_at : top_at + n_top])
                    if n_ids:
                        lp.ids = list(opts.token_ids_logprob)
                        lp.ids_logprobs = list(msg.ids_logprobs[ids_at : ids_at + n_ids])
                top_at += n_top
                ids_at += n_ids
                lps.append(lp)
            out = RequestOutput(e.req.rid, msg.token_ids[at], lps[0])
            if n > 1:
                out.more_tokens = list(msg.token_ids[at + 1 : at + n])
                if opts is not None:
                    out.more_logprobs = lps[1:]
            out.grammar_ended = (at + n - 1) in ended
            outputs.append(out)
            at += n
        return self._with_prompt_logprobs(msg, plan, outputs)

    def _with_prompt_logprobs(
        self, msg: pb.StepResult, plan: StepPlan, outputs: list[RequestOutput]
    ) -> StepResult:
        """The result: ``outputs`` plus the extends' prompt logprobs and
        embeddings, one output per rid."""
        if msg.prompt_logprobs or msg.embeddings:
            by_slot = {e.slot: e for e in plan.extends}
            for p in msg.prompt_logprobs:
                e = by_slot.get(p.slot)
                if e is None:
                    raise WorkerProtocolError(f"prompt logprobs for slot {p.slot}, not extended")
                outputs.append(self._prompt_output(e, p))
            for v in msg.embeddings:
                e = by_slot.get(v.slot)
                if e is None:
                    raise WorkerProtocolError(f"an embedding for slot {v.slot}, not extended")
                outputs.append(RequestOutput(e.req.rid, token_id=None, embedding=list(v.values)))
        return StepResult(msg.step_id, _merge_by_rid(outputs), msg.forward_ms, msg.idle_ms)

    @staticmethod
    def _prompt_output(e: PlanEntry, p: pb.PromptLogprobs) -> RequestOutput:
        opts = e.req.logprobs
        n_top, n_ids = opts.top_logprobs_num, len(opts.token_ids_logprob)
        entries: list[TokenLogprobs] = []
        scored = 0  # positions with a logprob (all but position 0)
        for value in p.logprobs:
            if math.isnan(value):
                entries.append(TokenLogprobs())
                continue
            t = TokenLogprobs(logprob=value)
            if n_top:
                t.top_ids = list(p.top_ids[scored * n_top : (scored + 1) * n_top])
                t.top_logprobs = list(p.top_logprobs[scored * n_top : (scored + 1) * n_top])
            if n_ids:
                t.ids = list(opts.token_ids_logprob)
                t.ids_logprobs = list(p.ids_logprobs[scored * n_ids : (scored + 1) * n_ids])
            scored += 1
            entries.append(t)
        return RequestOutput(
            e.req.rid, token_id=None, prompt_logprobs=entries, prompt_logprobs_start=p.start
        )


def _merge_by_rid(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request: a final chunk's prompt logprobs ride with its
    token, an embedding with its prompt logprobs."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        have = merged.get(out.rid)
        if have is None:
            merged[out.rid] = out
        else:
            if out.prompt_logprobs is not None:
                have.prompt_logprobs = out.prompt_logprobs
                have.prompt_logprobs_start = out.prompt_logprobs_start
            if out.embedding is not None:
                have.embedding = out.embedding
    return list(merged.values())
