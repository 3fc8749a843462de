"""Prefill here, decode there: a prompt prefilled by an in-process
default-model worker, its KV pushed over loopback gRPC (Worker.PushKv) into
other pages of a real worker process, which takes the request as a landed
join over its Execute stream and decodes the same greedy tokens (and
logprobs) as the prefilling worker decoding it itself."""

from __future__ import annotations

import grpc
import pytest

from protos import worker_pb2 as pb
from tests.worker_service.support.worker_factory import runner_for
from tests.worker_service.support.worker_process import PlanStream, worker_process
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.rpc.kv_sender import push_pages
from worker_service.sampling.params import LogprobOptions, SamplingParams

PAGE, STEPS = 4, 4
PROMPT = [1, 415, 2936, 9060, 285, 3, 7, 1208, 4, 88]
HERE, THERE = [5, 2, 7], [9, 1, 4]


def _colocated(runner) -> list[tuple[int, float]]:
    """The first token and STEPS decodes on the prefilling worker."""
    opts = LogprobOptions(return_logprob=True)
    join = Join(0, "r", SamplingParams(temperature=0.0), opts, len(PROMPT), [])
    plan = Plan(1, ForwardMode.PREFILL, joins=[join])
    plan.extends.append(Extend(0, 0, list(PROMPT), list(HERE), True))
    out = []
    result = runner.execute(plan)
    out.append((result.token_ids[0], result.logprobs[0]))
    pos, free = len(PROMPT), [20, 21]
    for step in range(STEPS):
        new = free.pop(0) + 1 if pos % PAGE == 0 else 0
        decode = Plan(2 + step, ForwardMode.DECODE, decode_slots=[0], decode_positions=[pos])
        decode.decode_new_pages.append(new)
        result = runner.execute(decode)
        assert not result.error, result.error
        out.append((result.token_ids[0], result.logprobs[0]))
        pos += 1
    return out


@pytest.mark.server
def test_a_prompt_prefilled_here_decodes_there_after_push_kv(tmp_path):
    runner = runner_for("default", num_pages=32, page_size=PAGE)
    colocated = _colocated(runner)
    args = ("--model", "default", "--page-size", str(PAGE), "--num-pages", "32")
    with worker_process(tmp_path, *args, "--no-swa-memory", "--threads", "1") as address:
        with grpc.insecure_channel(address) as channel:
            pushed = push_pages(
                channel,
                room="room-1",
                kv=runner.compute.kv,  # type: ignore[attr-defined]
                src_pages=HERE,
                dst_pages=THERE,
                pages_per_batch=2,
            )
        assert pushed == len(HERE)
        stream = PlanStream(address)
        try:
            greedy = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
            land = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
            land.joins.add(
                slot=0,
                rid="r",
                sampling=greedy,
                logprobs=pb.LogprobOptions(return_logprob=True, logprob_start_len=-1),
                prompt_len=len(PROMPT),
                prefix_ids=PROMPT,
                num_output_tokens=1,
                last_token=colocated[0][0],
                kv_pages=THERE,
            )
            result = stream.run(land)
            assert not result.error and not result.token_ids, result.error
            decoded, pos, free = [], len(PROMPT), [25, 26]
            for step in range(STEPS):
                plan = pb.StepPlan(step_id=2 + step, mode=pb.FORWARD_MODE_DECODE)
                plan.decode_slots.append(0)
                plan.decode_positions.append(pos)
                plan.decode_new_pages.append(free.pop(0) + 1 if pos % PAGE == 0 else 0)
                result = stream.run(plan)
                assert not result.error, result.error
                decoded.append((result.token_ids[0], result.logprobs[0]))
                pos += 1
        finally:
            stream.close()
    assert [t for t, _ in decoded] == [t for t, _ in colocated[1:]]
    for (_, a), (_, b) in zip(decoded, colocated[1:], strict=True):
        assert abs(a - b) < 1e-3
