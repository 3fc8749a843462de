"""The worker codec's speculative-decoding fields: draft_len on Extend, and
StepResult.token_counts decoded into RequestOutput.more_tokens/more_logprobs
(inconsistent counts refused)."""

from __future__ import annotations

import pytest

from protos import worker_pb2 as pb
from scheduler_service.core.plan import ForwardMode, Join, PlanEntry, StepPlan
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import LogprobOptions, SamplingParams
from scheduler_service.engine.worker_codec import WorkerCodec, WorkerProtocolError


def _codec(wants_a: bool = False) -> tuple[WorkerCodec, StepPlan, pb.StepPlan]:
    """A codec that sent a prefill of a, b, c (answered) and then a plan in
    which a drafts 3 tokens, b 1 and c decodes; the second plan."""
    codec = WorkerCodec()
    reqs = {
        rid: Request(rid, [1], logprobs=LogprobOptions(return_logprob=wants_a and rid == "a"))
        for rid in "abc"
    }
    joins = [Join(r.rid, SamplingParams(), r.logprobs, 1, prefix_ids=[]) for r in reqs.values()]
    first = StepPlan(
        1,
        ForwardMode.PREFILL,
        extends=[
            PlanEntry(r, 0, 0, [1], new_pages=[i], sample=True) for i, r in enumerate(reqs.values())
        ],
        joins=joins,
    )
    codec.encode(first)
    codec.decode(pb.StepResult(step_id=1, token_ids=[4, 5, 6], logprobs=[0.0, 0.0, 0.0]), first)
    plan = StepPlan(
        2,
        ForwardMode.MIXED,
        extends=[
            PlanEntry(reqs["a"], 0, 1, [4, 7, 8, 9], new_pages=[3], sample=True, drafts=[7, 8, 9]),
            PlanEntry(reqs["b"], 0, 1, [5, 1], new_pages=[4], sample=True, drafts=[1]),
        ],
        decodes=[PlanEntry(reqs["c"], 0, 1, None, new_pages=[5], sample=True)],
    )
    return codec, plan, codec.encode(plan)


def test_draft_len_is_encoded_and_counts_become_more_tokens():
    codec, plan, msg = _codec()
    assert [e.draft_len for e in msg.extends] == [3, 1]
    assert list(msg.extends[0].input_ids) == [4, 7, 8, 9]
    res = codec.decode(
        pb.StepResult(step_id=2, token_ids=[7, 8, 3, 11, 12], token_counts=[3, 1, 1]), plan
    )
    outs = {o.rid: o for o in res.outputs}
    assert (outs["a"].token_id, outs["a"].more_tokens) == (7, [8, 3])
    assert (outs["b"].token_id, outs["b"].more_tokens) == (11, None)
    assert (outs["c"].token_id, outs["c"].more_tokens) == (12, None)


def test_logprobs_per_token_of_a_drafted_entry():
    codec, plan, _ = _codec(wants_a=True)
    res = codec.decode(
        pb.StepResult(
            step_id=2,
            token_ids=[7, 8, 3, 11, 12],
            token_counts=[3, 1, 1],
            logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5],
        ),
        plan,
    )
    a = next(o for o in res.outputs if o.rid == "a")
    assert a.logprobs.logprob == pytest.approx(-0.1)
    assert [lp.logprob for lp in a.more_logprobs] == pytest.approx([-0.2, -0.3])


@pytest.mark.parametrize(
    ("tokens", "counts", "why"),
    [
        ([7, 8, 3, 11, 12], [3, 1], "token counts for 3 entries"),
        ([7, 8, 3, 9, 1, 11, 12], [5, 1, 1], "5 tokens for a with 3 drafts"),
        ([7, 11, 12, 13, 14], [1, 3, 1], "3 tokens for b with 1 drafts"),
        ([7, 11, 12], [1, 1, 2], "2 tokens for c with 0 drafts"),
        ([7, 11, 12], [2, 1, 1], "3 tokens, token_counts say 4"),
        ([7, 11, 12], [0, 2, 1], "0 tokens for a"),
    ],
)
def test_inconsistent_token_counts_are_refused(tokens, counts, why):
    codec, plan, _ = _codec()
    with pytest.raises(WorkerProtocolError, match=why):
        codec.decode(pb.StepResult(step_id=2, token_ids=tokens, token_counts=counts), plan)
