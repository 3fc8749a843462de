"""Worker.SendKv between two real worker processes on loopback: the prefill
worker prefills a prompt over its Execute stream, is told to push the
prompt's pages into other pages of the decode worker, which takes the
request as a landed join and decodes the tokens the prefill worker decodes
itself. The receiver's token is the sender's (a worker with another one
refuses, and SendKv answers UNAVAILABLE naming the room); bad orders are
refused."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from common.worker_token import metadata
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.worker_service.support.worker_process import PlanStream, worker_processes

PAGE, STEPS = 4, 4
PROMPT = [1, 415, 2936, 9060, 285, 3, 7, 1208, 4, 88]
HERE, THERE = [5, 2, 7], [9, 1, 4]
ARGS = ("--model", "default", "--page-size", str(PAGE), "--num-pages", "32")
ARGS += ("--no-swa-memory", "--threads", "1")
GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
LOGPROBS = pb.LogprobOptions(return_logprob=True, logprob_start_len=-1)


def _decodes(stream: PlanStream, first_step: int) -> list[tuple[int, float]]:
    out, pos, free = [], len(PROMPT), [25, 26]
    for step in range(STEPS):
        plan = pb.StepPlan(step_id=first_step + step, mode=pb.FORWARD_MODE_DECODE)
        plan.decode_slots.append(0)
        plan.decode_positions.append(pos)
        plan.decode_new_pages.append(free.pop(0) + 1 if pos % PAGE == 0 else 0)
        result = stream.run(plan)
        assert not result.error, result.error
        out.append((result.token_ids[0], result.logprobs[0]))
        pos += 1
    return out


def _prefill(stream: PlanStream) -> int:
    """Prefill PROMPT into pages HERE; its first token."""
    plan = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    plan.joins.add(slot=0, rid="r", sampling=GREEDY, logprobs=LOGPROBS, prompt_len=len(PROMPT))
    plan.extends.add(slot=0, start_pos=0, input_ids=PROMPT, new_pages=HERE, sample=True)
    result = stream.run(plan)
    assert not result.error, result.error
    return result.token_ids[0]


def _landing(first: int) -> pb.StepPlan:
    """The decode worker takes PROMPT's KV in pages THERE as a landed join."""
    land = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
    land.joins.add(
        slot=0,
        rid="r",
        sampling=GREEDY,
        logprobs=LOGPROBS,
        prompt_len=len(PROMPT),
        prefix_ids=PROMPT,
        num_output_tokens=1,
        last_token=first,
        kv_pages=THERE,
    )
    return land


@pytest.mark.server
def test_send_kv_moves_a_prefilled_prompt_to_a_worker_that_decodes_it(tmp_path):
    with worker_processes(tmp_path, ARGS, ARGS) as (prefill, decode):
        here, there = PlanStream(prefill), PlanStream(decode)
        try:
            first = _prefill(here)
            with grpc.insecure_channel(prefill) as channel:
                order = pb.SendKvRequest(
                    room="room-7", src_pages=HERE, target=decode, dst_pages=THERE
                )
                sent = worker_pb2_grpc.WorkerStub(channel).SendKv(order, timeout=60)
            assert sent.pages_sent == len(HERE) and not sent.shared_memory
            assert not there.run(_landing(first)).error
            colocated, disagg = _decodes(here, 2), _decodes(there, 2)
        finally:
            here.close()
            there.close()
    assert [t for t, _ in disagg] == [t for t, _ in colocated]
    for (_, a), (_, b) in zip(disagg, colocated, strict=True):
        assert abs(a - b) < 1e-3


@pytest.mark.server
def test_send_kv_shows_the_senders_token_and_refuses_bad_orders(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.write_text("token-a")
    theirs.write_text("token-b")
    sender = (*ARGS, "--worker-token-file", str(ours))
    same = (*ARGS, "--worker-token-file", str(ours))
    other = (*ARGS, "--worker-token-file", str(theirs))
    with (
        worker_processes(tmp_path, sender, same, other) as (a, b, c),
        grpc.insecure_channel(a) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)
        auth = metadata("token-a")

        def send(target: str, dst: list[int], src: list[int] = [1, 2]) -> pb.SendKvResponse:  # noqa: B006
            order = pb.SendKvRequest(room="rm", src_pages=src, target=target, dst_pages=dst)
            return stub.SendKv(order, metadata=auth, timeout=60)

        assert send(b, [3, 4]).pages_sent == 2
        with pytest.raises(grpc.RpcError) as err:
            send(c, [3, 4])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "room rm" in err.value.details()
        assert "UNAUTHENTICATED" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            send(b, [3])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            send(b, [3, 4], [1, 99])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the pool" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # no token: our own guard refuses
            stub.SendKv(pb.SendKvRequest(room="x", target=b), timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.server
def test_send_kv_copies_into_a_shared_memory_pool_on_one_host(tmp_path):
    """A decode worker with --kv-shared-memory: the prefill worker copies
    the pages straight into its pool file, and the landed join decodes the
    prefill worker's own tokens; the file goes with the worker."""
    shared = (*ARGS, "--kv-shared-memory")
    with worker_processes(tmp_path, ARGS, shared) as (prefill, decode):
        with grpc.insecure_channel(decode) as channel:
            path = worker_pb2_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest()).kv_shared_memory
        assert path.startswith("/dev/shm/radixserve-kv-") and Path(path).exists()
        here, there = PlanStream(prefill), PlanStream(decode)
        try:
            first = _prefill(here)
            with grpc.insecure_channel(prefill) as channel:
                order = pb.SendKvRequest(room="shm", src_pages=HERE, target=decode, dst_pages=THERE)
                sent = worker_pb2_grpc.WorkerStub(channel).SendKv(order, timeout=60)
            assert sent.shared_memory and sent.pages_sent == len(HERE)
            assert not there.run(_landing(first)).error
            colocated, disagg = _decodes(here, 2), _decodes(there, 2)
        finally:
            here.close()
            there.close()
    assert [t for t, _ in disagg] == [t for t, _ in colocated]
    assert not Path(path).exists()
