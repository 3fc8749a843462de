"""What a step's result means for its requests: tokens appended, logprobs
delivered (prompt positions once each), finish conditions checked.

``apply_result`` changes the requests' own token state and queues their
deltas; it moves no request anywhere: it returns the ones that finished,
with why, for the scheduler to finish (release, depart, forget).
"""

from __future__ import annotations

from scheduler_service.core.finish import StopStringChecker, check_finish
from scheduler_service.core.inflight import InFlight, ProtocolError
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import RequestOutput, StepResult
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.spec.settle import apply_drafted


def apply_result(
    record: InFlight,
    result: StepResult,
    now: float,
    stats: SchedulerStats,
    outbox: list[RequestDelta],
    eos_ids: frozenset[int],
    stop_strings: StopStringChecker | None,
) -> list[tuple[Request, FinishReason]]:
    """Apply ``result`` (the answer to the plan ``record`` remembers); return
    the requests it finished, in order, their finish delta already queued."""
    tokens = sum(1 for out in result.outputs if out.token_id is not None)
    if tokens != record.expected_tokens:
        raise ProtocolError(
            f"step {record.step_id}: {tokens} sampled tokens for "
            f"{record.expected_tokens} sampling entries"
        )
    finished: list[tuple[Request, FinishReason]] = []
    entries = record.entries
    drafts = record.drafts
    checks_strings = stop_strings is not None
    for out in result.outputs:
        item = entries.pop(out.rid, None)  # a second output for one entry is refused too
        if item is None:
            raise ProtocolError(f"step {record.step_id} has no entry for {out.rid!r}")
        req, epoch, samples = item
        token = out.token_id
        if samples != (token is not None):
            raise ProtocolError(f"step {record.step_id}: {out.rid} sampled {samples=}")
        if req.epoch != epoch:
            if samples:
                stats.discarded_tokens += 1 + len(out.more_tokens or ())
            continue
        drafted = drafts.get(out.rid) if drafts else None
        if drafted is not None:
            if out.prompt_logprobs:
                raise ProtocolError(f"step {record.step_id}: prompt logprobs for drafted {out.rid}")
            reason = apply_drafted(
                req, out, drafted[2], drafted[3], now, stats, outbox, eos_ids, stop_strings
            )
            if reason is not None:
                finished.append((req, reason))
            continue
        if out.more_tokens:
            raise ProtocolError(f"step {record.step_id}: {out.rid} has more tokens but no drafts")
        if token is None or out.prompt_logprobs or out.grammar_ended:
            reason = _apply_output(req, out, now, stats, outbox, eos_ids, stop_strings)
            if reason is not None:
                finished.append((req, reason))
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
            reason = check_finish(req, token, eos_ids, stop_strings)
            if reason is not None:
                delta.finished = True
                finished.append((req, reason))
    return finished


def _apply_output(
    req: Request,
    out: RequestOutput,
    now: float,
    stats: SchedulerStats,
    outbox: list[RequestDelta],
    eos_ids: frozenset[int],
    stop_strings: StopStringChecker | None,
) -> FinishReason | None:
    token = out.token_id
    if token is None:  # a prefill chunk: only prompt logprobs can come back
        delta = RequestDelta(req, [], [])
        take_prompt_logprobs(req, out, delta)
        if delta.prompt_logprobs:
            outbox.append(delta)
        return None
    delta = RequestDelta(req, [token], [out.logprobs])
    if out.prompt_logprobs:
        take_prompt_logprobs(req, out, delta)
    req.pending -= 1
    req.output_ids.append(token)
    stats.generated_tokens += 1
    if req.times.first_token is None:
        req.times.first_token = now
    outbox.append(delta)
    reason = check_finish(req, token, eos_ids, stop_strings, out.grammar_ended)
    if reason is not None:
        delta.finished = True
    return reason


def take_prompt_logprobs(req: Request, out: RequestOutput, delta: RequestDelta) -> None:
    """Put ``out``'s prompt logprobs into ``delta``, each prompt position once,
    even if a retracted request's re-prefill computes it again."""
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
