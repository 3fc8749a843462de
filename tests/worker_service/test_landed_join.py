"""A landed join (prefill/decode disaggregation, decode unit): the core's
Join with ``last_token`` and ``kv_pages`` crosses the wire (codec, protobuf,
the worker's convert), the worker takes the pages as the slot's table
without computing, and the first decode computes the first token. With the
KV copied from another worker's pool (the transfer simulated in process),
a landed request decodes the same greedy tokens and logprobs as a request
prefilled where it decodes: with the simulated model and the default one.
Bad landed joins are refused by name, leaving the worker as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from protos import worker_pb2 as pb
from scheduler_service.core.plan import ForwardMode as CoreMode
from scheduler_service.core.plan import Join as CoreJoin
from scheduler_service.core.plan import StepPlan
from scheduler_service.core.sampling import LogprobOptions as CoreLogprobs
from scheduler_service.core.sampling import SamplingParams as CoreSampling
from scheduler_service.engine.worker_codec import WorkerCodec
from tests.worker_service.support.worker_factory import runner_for
from worker_service.execution.convert import plan_from_proto
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.execution.simulated_compute import SimulatedCompute
from worker_service.sampling.params import LogprobOptions, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
LOGPROBS = LogprobOptions(return_logprob=True, top_logprobs_num=2)
PAGE = 4


def test_a_landed_join_crosses_the_codec_and_a_plain_one_is_unchanged():
    codec = WorkerCodec()
    sampling, lp = CoreSampling(max_new_tokens=5), CoreLogprobs()
    landed = CoreJoin(
        "a",
        sampling,
        lp,
        6,
        prefix_ids=list(range(6)),
        num_output_tokens=1,
        last_token=42,
        kv_pages=[9, 3],
    )
    plain = CoreJoin("b", sampling, lp, 6, prefix_ids=[1, 2, 3, 4])
    msg = codec.encode(StepPlan(1, CoreMode.IDLE, joins=[landed, plain]))
    wire = pb.StepPlan.FromString(msg.SerializeToString())
    a, b = plan_from_proto(wire).joins
    assert (a.last_token, a.kv_pages, a.prefix_ids, a.num_output_tokens) == (
        42,
        [9, 3],
        list(range(6)),
        1,
    )
    assert (b.last_token, b.kv_pages) == (None, [])
    assert not wire.joins[1].HasField("last_token")


Output = tuple[int, float, list[int]]  # token, logprob, top ids


def _outputs(runner: ModelRunner, plan: Plan) -> list[Output]:
    result = runner.execute(plan)
    assert not result.error, result.error
    out, top_at = [], 0
    for i in range(len(result.slots)):
        n = result.top_counts[i] if result.top_counts else 0
        out.append(
            (result.token_ids[i], result.logprobs[i], list(result.top_ids[top_at : top_at + n]))
        )
        top_at += n
    return out


def _decode(runner: ModelRunner, step: int, pos: int, new_page: int) -> Plan:
    return Plan(
        step,
        ForwardMode.DECODE,
        decode_slots=[0],
        decode_positions=[pos],
        decode_new_pages=[new_page + 1 if new_page >= 0 else 0],
    )


def _decode_steps(
    runner: ModelRunner, start_step: int, pos: int, pages: list[int], free: list[int], n: int
):
    out = []
    for k in range(n):
        p = pos + k
        new = -1
        if p // PAGE >= len(pages):
            new = free.pop()
            pages.append(new)
        out += _outputs(runner, _decode(runner, start_step + k, p, new))
    return out


def _compare(
    make: Callable[[], ModelRunner],
    copy: Callable[[ModelRunner, ModelRunner, list[int], list[int]], None],
    prompt: list[int],
    n: int,
) -> tuple[list[Output], list[Output]]:
    """(co-located, landed) outputs of the n decodes after the first token."""
    # Co-located: prefill here, then decode n tokens.
    here = make()
    here_pages = [5, 2, 7][: -(-len(prompt) // PAGE)]
    first = _outputs(
        here,
        Plan(
            1,
            ForwardMode.PREFILL,
            joins=[Join(0, "r", GREEDY, LOGPROBS, len(prompt), [])],
            extends=[Extend(0, 0, list(prompt), list(here_pages), True)],
        ),
    )
    assert len(first) == 1
    colocated = first + _decode_steps(here, 2, len(prompt), list(here_pages), [11, 12, 13], n)
    # Disaggregated: the prompt's KV copied into other pages of another pool;
    # a landed join, then the same decodes.
    there = make()
    there_pages = [9, 1, 4][: len(here_pages)]
    copy(here, there, here_pages, there_pages)
    token = first[0][0]
    landed = Join(
        0,
        "r",
        GREEDY,
        LOGPROBS,
        len(prompt),
        list(prompt),
        1,
        last_token=token,
        kv_pages=list(there_pages),
    )
    assert _outputs(there, Plan(1, ForwardMode.IDLE, joins=[landed])) == []
    disagg = _decode_steps(there, 2, len(prompt), list(there_pages), [14, 15, 16], n)
    return colocated[1:], disagg


def _simulated() -> ModelRunner:
    return ModelRunner(
        SimulatedCompute(vocab_size=500), num_pages=32, page_size=PAGE, vocab_size=500
    )


def _no_copy(*_: object) -> None:
    pass  # the simulated model reads no KV: the slot's tokens carry its context


def test_a_landed_join_on_the_simulated_worker_decodes_as_a_colocated_one():
    colocated, disagg = _compare(_simulated, _no_copy, [3, 14, 15, 92, 65, 35, 89], 6)
    assert disagg == colocated


def _copy_kv(
    src: ModelRunner, dst: ModelRunner, src_pages: list[int], dst_pages: list[int]
) -> None:
    for a, b in zip(src.compute.kv.layers, dst.compute.kv.layers, strict=True):  # type: ignore[attr-defined]
        b[torch.tensor(dst_pages)] = a[torch.tensor(src_pages)]


@pytest.mark.slow
def test_a_landed_join_on_the_default_model_decodes_the_colocated_tokens_and_logprobs():
    def make() -> ModelRunner:
        return runner_for("default", num_pages=32, page_size=PAGE)

    colocated, disagg = _compare(make, _copy_kv, [1, 415, 2936, 9060, 285, 3, 7, 1208, 4], 5)
    assert [t for t, _, _ in disagg] == [t for t, _, _ in colocated]
    assert disagg == colocated  # logprobs and top ids too, bit for bit


def test_without_the_copy_the_default_model_decodes_otherwise():
    """The check above is not vacuous: a landed join's decode reads the pages."""

    def make() -> ModelRunner:
        return runner_for("default", num_pages=32, page_size=PAGE)

    colocated, disagg = _compare(make, _no_copy, [1, 415, 2936, 9060, 285, 3, 7, 1208, 4], 3)
    assert disagg != colocated


def _refused(join: Join, match: str) -> None:
    runner = _simulated()
    result = runner.execute(Plan(1, ForwardMode.IDLE, joins=[join]))
    assert match in result.error
    assert not runner.slots


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"last_token": None}, "kv_pages without last_token"),
        ({"last_token": 500}, "outside the vocabulary"),
        ({"prompt_len": 7}, "whole prompt"),
        ({"kv_pages": [1]}, "cannot hold"),
        ({"kv_pages": [1, 2, 3, 4]}, "at most 3"),
        ({"kv_pages": [1, 32]}, "outside the pool"),
        ({"kv_pages": [2, 2]}, "twice"),
        ({"pooling": "last"}, "embedding"),
    ],
)
def test_a_bad_landed_join_is_refused_by_name(changes: dict, match: str):
    fields = {"last_token": 7, "kv_pages": [1, 2], "prompt_len": 6}
    fields.update(changes)
    join = Join(
        0, "r", GREEDY, LogprobOptions(), fields.pop("prompt_len"), list(range(6)), 1, **fields
    )
    _refused(join, match)


def test_a_landed_join_then_an_extend_in_one_plan_is_refused():
    join = Join(
        0, "r", GREEDY, LogprobOptions(), 6, list(range(6)), 1, last_token=7, kv_pages=[1, 2]
    )
    runner = _simulated()
    plan = Plan(1, ForwardMode.PREFILL, joins=[join], extends=[Extend(0, 6, [8], [], True)])
    assert "sampled token" in runner.execute(plan).error
