"""What a step's result means for its requests: tokens received, logprobs
delivered (prompt positions once each), finish conditions checked.

Receiving a token is written once (``receive_token``): a decode's token, the
token after a prompt's last chunk and each token of a drafted row (the
accepted drafts and the sample after them) all go through it, with the
finish check after each; tokens after a finish are dropped. The one copy is
``_apply_tokens``, its loop unrolled over a result's token column
(``StepResult.tokens``: a batch of plain tokens, the common step), which
must decide exactly as it does (tests/scheduler_service/core/
test_scheduler_properties.py runs every workload in both forms).

``apply_result`` changes the requests' own token state and writes nothing
of the scheduler's: it returns a ``Receipt`` (the deltas, the requests that
finished and why, token counts) for the scheduler to take in (finish them
through the request table, queue the deltas, count).

Finish order, for the token just appended (SGLang's update_finish_state
order): the end of its grammar (structured generation), stop string, then
EOS / stop token id, then length. ``min_new_tokens`` holds back EOS and stop
ids only, as in SGLang: the worker masks them while fewer than
``min_new_tokens`` tokens exist, and the scheduler applies the same rule for
workers that do not mask (the simulated one). Stop strings count from the
first token.

A request with stop strings has its newest text checked after every token
(``StopStringChecker``); when the text ends with the start of a stop string
the delta says ``holding``, and a streaming call sends nothing until a later
token settles it (SGLang's check_match_stop_str_prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler_service.core.outputs import RequestDelta, plain_delta
from scheduler_service.core.plan import (
    PlanEntry,
    ProtocolError,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from scheduler_service.core.request import FinishLength, FinishReason, FinishStop, Request
from scheduler_service.core.stop_check import StopCheck


class StopStringChecker(Protocol):
    """Decodes the request's newest text and checks it against its stop
    strings (``stop_check.check_stop_text``).

    Called after each token appended to a request that has stop strings. The
    service decodes the tail of the output with special tokens kept (SGLang's
    tail_str), so a stop string that spells a special token matches whatever
    the request's skip_special_tokens says.
    """

    def __call__(self, req: Request) -> StopCheck: ...


@dataclass(slots=True)
class Receipt:
    """What one result brought: the deltas for the clients, the requests it
    finished (in order, their finish delta among the deltas) and the token
    counts for the statistics. ``apply_result`` fills and returns it; the
    scheduler takes it in."""

    now: float
    eos_ids: frozenset[int]
    stop_strings: StopStringChecker | None
    deltas: list[RequestDelta] = field(default_factory=list)
    finished: list[tuple[Request, FinishReason]] = field(default_factory=list)
    generated: int = 0
    discarded: int = 0  # sampled for requests that had moved on, or after a finish
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Embedding requests whose vector this result brought.
    embedded: set[str] = field(default_factory=set)


def check_finish(
    req: Request,
    token: int,
    eos_token_ids: frozenset[int],
    matched_stop: str | None,
    *,
    grammar_ended: bool = False,
) -> FinishReason | None:
    """Why ``req`` finished with ``token`` (just appended), or None;
    ``matched_stop``: the stop string its newest text holds, if any."""
    sp = req.sampling
    n = len(req.output_ids)
    if grammar_ended:
        # The grammar admits nothing after this token (it is usually EOS, which
        # the grammar allows only where it can end): done, whatever
        # ignore_eos or min_new_tokens say, unless the length ran out with it.
        return FinishLength(sp.max_new_tokens) if n >= sp.max_new_tokens else FinishStop(token)
    if matched_stop is not None:
        return FinishStop(matched_stop)
    if (
        n > sp.min_new_tokens
        and not sp.ignore_eos
        and (token in sp.stop_token_ids or token in eos_token_ids)
    ):
        return FinishStop(token)
    if n >= sp.max_new_tokens:
        return FinishLength(sp.max_new_tokens)
    return None


def receive_token(
    req: Request,
    token: int,
    lp: TokenLogprobs | None,
    delta: RequestDelta,
    *,
    r: Receipt,
    grammar_ended: bool,
) -> FinishReason | None:
    """Append one sampled token to ``req`` and ``delta``; why it finished, if
    it did (``delta`` then says so). check_finish runs only when one of its
    conditions can hold: most tokens end nothing."""
    output_ids = req.output_ids
    output_ids.append(token)
    delta.new_token_ids.append(token)
    delta.logprobs.append(lp)
    r.generated += 1
    sp = req.sampling
    n = len(output_ids)
    matched = None
    if sp.stop_strs and r.stop_strings is not None:
        matched, delta.holding = r.stop_strings(req)
    if (
        n >= sp.max_new_tokens
        or grammar_ended
        or matched is not None
        or (
            n > sp.min_new_tokens
            and not sp.ignore_eos
            and (token in sp.stop_token_ids or token in r.eos_ids)
        )
    ):
        reason = check_finish(req, token, r.eos_ids, matched, grammar_ended=grammar_ended)
        if reason is not None:
            delta.finished = True
            return reason
    return None


def apply_result(
    plan: StepPlan,
    result: StepResult,
    *,
    now: float,
    eos_ids: frozenset[int],
    stop_strings: StopStringChecker | None,
) -> Receipt:
    """Apply ``result`` (the answer to ``plan``) to its requests' tokens; what
    it brought (``Receipt``).

    A result answers its plan in plan order: one output per sampling entry
    (extends, then decodes), then outputs for extends that sampled nothing
    but scored prompt positions (prompt logprobs) or pooled an embedding,
    in any order."""
    r = Receipt(now, eos_ids, stop_strings)
    step = plan.step_id
    extends = plan.extends
    sampling = [e for e in extends if e.sample] + plan.decodes if extends else plan.decodes
    if result.tokens is not None:
        if result.outputs:
            raise ProtocolError(f"step {step}: a token column and outputs in one result")
        _apply_tokens(sampling, result.tokens, r, step)
        return r
    outputs = result.outputs
    n = len(sampling)
    if len(outputs) < n or (len(outputs) > n and outputs[n].token_id is not None):
        tokens = sum(1 for out in outputs if out.token_id is not None)
        raise ProtocolError(f"step {step}: {tokens} sampled tokens for {n} sampling entries")
    finished, deltas = r.finished, r.deltas
    for entry, out in zip(sampling, outputs, strict=False):  # the rest: after the loop
        req = entry.req
        token = out.token_id
        if out.rid != req.rid or token is None:
            raise ProtocolError(
                f"step {step} has no entry for {out.rid!r} (token {token}) where "
                f"{req.rid!r} samples"
            )
        if (
            entry.drafts is not None
            or req.epoch != entry.epoch
            or out.prompt_logprobs
            or out.more_tokens
            or not req.sampling.max_new_tokens
            or out.embedding is not None
        ):
            reason = _receive(entry, out, r, step)
        else:  # a plain sampled token (most of them): _receive's last branch
            req.pending -= 1
            if req.times.first_token is None:
                req.times.first_token = now
            delta = RequestDelta(req, [], [])
            deltas.append(delta)
            reason = receive_token(
                req, token, out.logprobs, delta, r=r, grammar_ended=out.grammar_ended
            )
        if reason is not None:
            finished.append((req, reason))
    if len(outputs) > n:
        scoring = {e.req.rid: e for e in extends if not e.sample}
        for out in outputs[n:]:
            entry = scoring.pop(out.rid, None)  # a second output for one entry is refused too
            if entry is None or out.token_id is not None:
                raise ProtocolError(f"step {step} has no entry without a sample for {out.rid!r}")
            _receive(entry, out, r, step)
    return r


def _apply_tokens(sampling: list[PlanEntry], tokens: list[int], r: Receipt, step: int) -> None:
    """A result's token column: ``receive_token`` unrolled for a batch of
    plain tokens (no function call and no RequestOutput per token: this is
    most of a decode step's update). An entry off the plain path (drafted,
    moved on since it was planned, prefill-only scoring, asking for
    logprobs) goes through ``_receive`` as its output would."""
    if len(tokens) != len(sampling):
        raise ProtocolError(
            f"step {step}: {len(tokens)} sampled tokens for {len(sampling)} sampling entries"
        )
    now, eos_ids, stop_strings = r.now, r.eos_ids, r.stop_strings
    finished = r.finished
    add = r.deltas.append
    plain = 0
    for entry, token in zip(sampling, tokens, strict=True):
        req = entry.req
        sp = req.sampling
        if (
            entry.drafts is not None
            or req.epoch != entry.epoch
            or not sp.max_new_tokens
            or req.logprobs.return_logprob
        ):
            reason = _receive(entry, RequestOutput(req.rid, token), r, step)
            if reason is not None:
                finished.append((req, reason))
            continue
        req.pending -= 1
        times = req.times
        if times.first_token is None:
            times.first_token = now
        output_ids = req.output_ids
        output_ids.append(token)
        delta = plain_delta(req, token)
        add(delta)
        plain += 1
        n = len(output_ids)
        matched = None
        if sp.stop_strs and stop_strings is not None:
            matched, delta.holding = stop_strings(req)
            delta.plain = not delta.holding
        if (
            n >= sp.max_new_tokens
            or matched is not None
            or (
                n > sp.min_new_tokens
                and not sp.ignore_eos
                and (token in sp.stop_token_ids or token in eos_ids)
            )
        ):
            reason = check_finish(req, token, eos_ids, matched)
            if reason is not None:
                delta.finished = True
                delta.plain = False
                finished.append((req, reason))
    r.generated += plain


def _receive(entry: PlanEntry, out: RequestOutput, r: Receipt, step: int) -> FinishReason | None:
    """One entry's output: its prompt logprobs, then its tokens."""
    req = entry.req
    token = out.token_id
    if entry.sample != (token is not None):
        raise ProtocolError(f"step {step}: {out.rid} sampled {entry.sample=}")
    drafts = entry.drafts
    if out.more_tokens and drafts is None:
        raise ProtocolError(f"step {step}: {out.rid} has more tokens but no drafts")
    if drafts is not None and out.prompt_logprobs:
        raise ProtocolError(f"step {step}: prompt logprobs for drafted {out.rid}")
    if out.embedding is not None and token is not None:
        raise ProtocolError(f"step {step}: {out.rid} sampled and pooled an embedding")
    if req.epoch != entry.epoch:  # it moved on since: what it sampled is stale
        if token is not None:
            r.discarded += 1 + len(out.more_tokens or ())
        return None
    if token is None:  # a prefill chunk: prompt logprobs or an embedding can come back
        delta = RequestDelta(req, [], [])
        take_prompt_logprobs(req, out, delta)
        if out.embedding is not None:
            if req.embed is None or entry.start_pos + entry.num_tokens != len(req.prompt_ids):
                raise ProtocolError(f"step {step}: an embedding for {out.rid} at no prompt's end")
            delta.embedding = out.embedding
            r.embedded.add(req.rid)
        if delta.prompt_logprobs or delta.embedding is not None:
            r.deltas.append(delta)
        return None
    delta = RequestDelta(req, [], [])
    if out.prompt_logprobs:
        take_prompt_logprobs(req, out, delta)
    if not req.sampling.max_new_tokens:
        # Prefill-only scoring sampled for its next-token row only: no token;
        # the scheduler finishes it with the rest of its plan.
        delta.next_token_logprobs = out.logprobs
        r.deltas.append(delta)
        return None
    req.pending -= 1
    if req.times.first_token is None:
        req.times.first_token = r.now
    r.deltas.append(delta)
    if drafts is None:
        return receive_token(req, token, out.logprobs, delta, r=r, grammar_ended=out.grammar_ended)
    return _receive_drafted(entry, out, delta, r)


def _receive_drafted(
    entry: PlanEntry, out: RequestOutput, delta: RequestDelta, r: Receipt
) -> FinishReason | None:
    """A drafted row's tokens: the accepted drafts and the sample after them.
    Its kv_len becomes what the worker kept (start_pos + accepted + 1; the
    scheduler frees the pages past it when the plan settles)."""
    req, drafts = entry.req, entry.drafts or []
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
    req.kv_len = entry.start_pos + accepted + 1
    req.spec_draft_tokens += len(drafts)
    req.spec_accepted_tokens += accepted
    r.draft_tokens += len(drafts)
    r.accepted_tokens += accepted
    last = len(tokens) - 1
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        ended = out.grammar_ended and i == last  # it is about the entry's last token
        reason = receive_token(req, token, lp, delta, r=r, grammar_ended=ended)
        if reason is not None:
            r.discarded += last - i
            return reason
    return None


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
