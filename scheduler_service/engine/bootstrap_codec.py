"""The bootstrap channel's messages (protos/bootstrap.proto) <-> the core's
dataclasses: the one place they meet."""

from __future__ import annotations

from protos import bootstrap_pb2 as bpb
from scheduler_service.core.disagg.orders import KvSend
from scheduler_service.core.plan import TokenLogprobs


def logprobs_to_proto(lp: TokenLogprobs) -> bpb.TokenLogprobs:
    m = bpb.TokenLogprobs(
        top_ids=lp.top_ids or (),
        top_logprobs=lp.top_logprobs or (),
        ids=lp.ids or (),
        ids_logprobs=lp.ids_logprobs or (),
        has_top=lp.top_ids is not None,
        has_ids=lp.ids is not None,
    )
    if lp.logprob is not None:
        m.logprob = lp.logprob
    return m


def logprobs_from_proto(m: bpb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        logprob=m.logprob if m.HasField("logprob") else None,
        top_ids=list(m.top_ids) if m.has_top else None,
        top_logprobs=list(m.top_logprobs) if m.has_top else None,
        ids=list(m.ids) if m.has_ids else None,
        ids_logprobs=list(m.ids_logprobs) if m.has_ids else None,
    )


def claim_result(order: KvSend) -> bpb.ClaimResult:
    """What the decode unit gets once ``order``'s KV is in its pages."""
    result = bpb.ClaimResult(
        first_token=order.first_token,
        cached_tokens=order.cached_tokens,
        grammar_ended=order.grammar_ended,
        pages_sent=len(order.pages),
    )
    if order.logprobs is not None:
        result.logprobs.CopyFrom(logprobs_to_proto(order.logprobs))
    return result


__all__ = ["claim_result", "logprobs_from_proto", "logprobs_to_proto"]
