"""A drafted entry's result (speculative decoding): the accepted drafts and
the sample after them, applied one token at a time with the finish check
after each; tokens after a finish are dropped (docs/design.md)."""

from __future__ import annotations

from scheduler_service.core.finish import StopStringChecker, check_finish
from scheduler_service.core.inflight import ProtocolError
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import RequestOutput
from scheduler_service.core.request import FinishReason, Request

# rid -> (request, epoch, start_pos, drafts): InFlight.drafts
Drafts = dict[str, tuple[Request, int, int, list[int]]]


def apply_drafted(
    req: Request,
    out: RequestOutput,
    start_pos: int,
    drafts: list[int],
    now: float,
    stats: SchedulerStats,
    outbox: list[RequestDelta],
    eos_ids: frozenset[int],
    stop_strings: StopStringChecker | None,
) -> FinishReason | None:
    """Apply ``out`` for ``req``'s drafted entry; set its kv_len to what the
    worker kept (start_pos + accepted + 1; the scheduler frees the pages
    past it) and count the drafts. Returns why it finished, if it did."""
    more = out.more_tokens or []
    tokens = [out.token_id, *more]
    accepted = len(more)
    if accepted > len(drafts) or tokens[:accepted] != drafts[:accepted]:
        raise ProtocolError(
            f"{out.rid}: the worker answered {tokens} for the drafts {drafts}: "
            "accepted tokens must be a prefix of the drafts"
        )
    more_lp = out.more_logprobs
    if more_lp is not None and len(more_lp) != accepted:
        raise ProtocolError(f"{out.rid}: {len(more_lp)} logprobs for {accepted} more tokens")
    logprobs = [out.logprobs, *(more_lp if more_lp is not None else [None] * accepted)]
    req.pending -= 1
    req.kv_len = start_pos + accepted + 1
    req.spec_draft_tokens += len(drafts)
    req.spec_accepted_tokens += accepted
    stats.spec_draft_tokens += len(drafts)
    stats.spec_accepted_tokens += accepted
    if req.times.first_token is None:
        req.times.first_token = now
    delta = RequestDelta(req, [], [])
    outbox.append(delta)
    reason = None
    last = len(tokens) - 1
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        req.output_ids.append(token)
        delta.new_token_ids.append(token)
        delta.logprobs.append(lp)
        stats.generated_tokens += 1
        ended = out.grammar_ended and i == last  # it is about the entry's last token
        reason = check_finish(req, token, eos_ids, stop_strings, ended)
        if reason is not None:
            delta.finished = True
            break
    dropped = len(tokens) - len(delta.new_token_ids)
    stats.discarded_tokens += dropped
    return reason


def settle_drafts(drafts: Drafts, kv: KvManager, step: int) -> None:
    """After a drafted plan's result was applied: each request's adaptive k
    learns what was accepted, and its pages past the accepted tokens go back
    at once (its kv_len was set by apply_drafted)."""
    for req, epoch, start, d in drafts.values():
        if req.epoch == epoch:  # not aborted meanwhile
            req.spec.inflight = 0
            req.spec.verified(len(d), req.kv_len - start - 1, step)
            kv.trim(req)
