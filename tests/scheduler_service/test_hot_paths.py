"""The per-step fast paths give what the general paths give: the core's
outputs as columns (ipc.Outputs), the result decoder without logprobs, and
the scheduler's inlined decode update."""

from __future__ import annotations

import pickle

from protos import worker_pb2 as pb
from scheduler_service import ipc
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.plan import ForwardMode, Join, PlanEntry, StepPlan
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import LogprobOptions, SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.loop import Engine
from scheduler_service.engine.worker_codec import WorkerCodec


class FakeConn:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(pickle.loads(pickle.dumps(msg)))  # as the pipe carries it


def _load() -> ipc.Load:
    return ipc.Load(0, 0, 0, 64, 0.0, 0, 0, 0.0, 0.0, 0.0, 8)


def test_outputs_items_interleave_columns_and_deltas_in_order():
    fin = ipc.DeltaOut("b", [7], finish=ipc.Finish("length"))
    lp = ipc.DeltaOut("c", [8], logprobs=[None])
    out = ipc.Outputs(
        [fin, lp], _load(), [], ["a", "b", "d", "c"], [5, None, 6, None], [3, 0, 0, 0]
    )
    assert out.items() == [
        ipc.DeltaOut("a", [5], cached_tokens=3),
        fin,
        ipc.DeltaOut("d", [6]),
        lp,
    ]
    assert all(type(d) is ipc.DeltaOut for d in out.items())
    # without columns, the deltas are all (the older form)
    assert ipc.Outputs([fin], _load()).items() == [fin]


def _engine(n: int, logprob_rids: set[str] = frozenset()) -> tuple[Engine, FakeConn]:
    cfg = SchedulerConfig(page_size=4, max_running_requests=8, eos_token_ids=frozenset({2}))
    sched = Scheduler(cfg, 256)
    for i in range(n):
        rid = f"r{i}"
        lp = LogprobOptions(return_logprob=True) if rid in logprob_rids else LogprobOptions()
        sched.add_request(
            Request(rid, [10 + i, 11, 12], SamplingParams(max_new_tokens=3), logprobs=lp)
        )
    conn = FakeConn()
    return Engine(sched, None, conn, overlap_depth=1, recovery_timeout_s=60), conn


def _run_steps(eng: Engine, tokens: list[int]) -> list[ipc.DeltaOut]:
    """Drive the scheduler through plan -> codec -> result; collect what the API sees."""
    got: list[ipc.DeltaOut] = []
    sched, codec = eng.sched, eng.codec
    k = 0
    while not sched.is_idle():
        plan = sched.step()
        msg = codec.encode(plan)
        n = len(msg.decode_slots) + sum(1 for e in msg.extends if e.sample)
        res = pb.StepResult(step_id=plan.step_id, token_ids=tokens[k : k + n], logprobs=[-0.5] * n)
        k += n
        sched.update(codec.decode(res, plan))
        eng._publish()
        for m in eng.conn.sent:
            got.extend(m.items())
        eng.conn.sent.clear()
    return got


def test_published_deltas_match_the_general_conversion():
    eng, _ = _engine(3, logprob_rids={"r1"})
    # r0: 5, 2 (EOS: finishes); r1 (logprobs): 6, 7, 8 (length); r2: 9, 9, 9
    got = _run_steps(eng, [5, 6, 9, 2, 7, 9, 8, 9])
    by_rid: dict[str, list[ipc.DeltaOut]] = {}
    for d in got:
        by_rid.setdefault(d.rid, []).append(d)
    assert [d.token_ids for d in by_rid["r0"]] == [[5], [2]]
    assert by_rid["r0"][-1].finish == ipc.Finish("stop", matched_token=2)
    assert by_rid["r0"][0] == ipc.DeltaOut("r0", [5])  # a column entry
    assert [d.token_ids for d in by_rid["r1"]] == [[6], [7], [8]]
    assert all(d.logprobs and d.logprobs[0].logprob == -0.5 for d in by_rid["r1"])
    assert by_rid["r1"][-1].finish == ipc.Finish("length", message="")
    assert [d.token_ids for d in by_rid["r2"]] == [[9], [9], [9]]
    assert by_rid["r2"][-1].finish.kind == "length"
    assert eng.sched.stats.generated_tokens == 8


def _plan_two_decodes(codec: WorkerCodec, wants: bool) -> tuple[StepPlan, StepPlan]:
    lp = LogprobOptions(return_logprob=wants)
    a, b = Request("a", [1], logprobs=lp), Request("b", [1])
    joins = [Join(r.rid, SamplingParams(), r.logprobs, 1, prefix_ids=[]) for r in (a, b)]
    plan = StepPlan(
        1,
        ForwardMode.PREFILL,
        extends=[
            PlanEntry(a, 0, 0, [1], new_pages=[0], sample=True),
            PlanEntry(b, 0, 0, [1], new_pages=[1], sample=True),
        ],
        joins=joins,
    )
    codec.encode(plan)
    second = StepPlan(
        2,
        ForwardMode.DECODE,
        decodes=[
            PlanEntry(a, 0, 1, None, new_pages=[], sample=True),
            PlanEntry(b, 0, 1, None, new_pages=[], sample=True),
        ],
    )
    codec.encode(second)
    return plan, second


def test_result_decoding_with_and_without_logprob_payloads():
    for wants in (False, True):
        codec = WorkerCodec()
        one, two = _plan_two_decodes(codec, wants)
        first = codec.decode(pb.StepResult(step_id=1, token_ids=[3, 4], logprobs=[-1.0, -2.0]), one)
        second = codec.decode(
            pb.StepResult(step_id=2, token_ids=[5, 6], logprobs=[-3.0, -4.0]), two
        )
        for res, tokens, lp_a in ((first, [3, 4], -1.0), (second, [5, 6], -3.0)):
            if not wants:  # plain tokens: the column form, no RequestOutput each
                assert res.tokens == tokens and res.outputs == []
                continue
            assert res.tokens is None
            assert [(o.rid, o.token_id) for o in res.outputs] == list(
                zip("ab", tokens, strict=True)
            )
            assert res.outputs[1].logprobs is None
            assert (res.outputs[0].logprobs is not None) == wants
            if wants:
                assert res.outputs[0].logprobs.logprob == lp_a
