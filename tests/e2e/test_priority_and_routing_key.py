"""Priority and routing key arrive over the public API in
SamplingParams.custom_params (the proto has no field for them) and reach the
scheduler: with --enable-priority-scheduling a high-priority request preempts
a low-priority one on a full pool and takes the place of a lower one in a
full queue (whose client hears why), and the routing-key policy runs a
waiting request whose key is in the running batch before an older one."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.cli import _sampling, build_parser
from clients.results import Sampling
from tests.e2e.support.metrics import scrape
from tests.e2e.support.sim_server import assert_idle_and_clean, simulated_server
from tests.e2e.support.system import free_port, stub


def _request(rid: str, prompt: list[int], max_new: int, **custom) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    if custom:
        params = Struct()
        params.update(custom)
        sp.custom_params.CopyFrom(params)
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sp
    )


async def _run(s: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest, log: list) -> int:
    """Stream ``req`` to its end; log (rid, "first"|"done") as they happen."""
    req.stream = True
    tokens = 0
    async for r in s.Generate(req, timeout=60):
        if tokens == 0 and r.chunk.token_ids:
            log.append((req.request_id, "first"))
        tokens += len(r.chunk.token_ids)
    log.append((req.request_id, "done"))
    return tokens


def test_client_sends_priority_and_routing_key_in_custom_params():
    m = pb.SamplingParams()
    Sampling(priority=-3, routing_key="tenant-a").to_proto(m)
    assert dict(m.custom_params) == {"priority": -3.0, "routing_key": "tenant-a"}
    m = pb.SamplingParams()
    Sampling(speculative=False).to_proto(m)
    assert dict(m.custom_params) == {"speculative": False}
    m = pb.SamplingParams()
    Sampling().to_proto(m)
    assert not m.HasField("custom_params")


def test_cli_flags_become_sampling_parameters():
    args = build_parser().parse_args(
        ["generate", "hi", "--priority", "-7", "--routing-key", "tenant-b"]
    )
    sampling = _sampling(args)
    assert (sampling["priority"], sampling["routing_key"]) == (-7, "tenant-b")
    assert "priority" not in _sampling(build_parser().parse_args(["generate", "hi"]))


def test_high_priority_preempts_low_priority_on_a_full_pool(tmp_path):
    # 64 pages of 4 tokens: the low-priority request's expected need (its
    # remaining max_new_tokens times new_token_ratio, as SGLang counts it)
    # leaves no room for the high-priority one, which must preempt it
    port = free_port()
    args = ("--enable-priority-scheduling", "--metrics-port", str(port))
    with simulated_server(tmp_path, num_pages=64, step_ms=2.0, scheduler_args=args) as address:

        async def run() -> tuple[list, list[int]]:
            log: list = []
            async with grpc.aio.insecure_channel(address) as ch:
                s = pb_grpc.SglangSchedulerStub(ch)
                low = asyncio.create_task(_run(s, _request("low", [7] * 8, 240, priority=0), log))
                while ("low", "first") not in log:
                    await asyncio.sleep(0.005)
                high = _run(s, _request("high", [9] * 8, 100, priority=100), log)
                return log, await asyncio.gather(low, high)

        log, tokens = asyncio.run(run())
        assert tokens == [240, 100]  # the preempted request resumed and finished in full
        assert log.index(("high", "done")) < log.index(("low", "done")), log
        assert scrape(port)["radixserve_preemptions_total"] >= 1
        assert_idle_and_clean(stub(address))


def test_a_full_queue_evicts_the_lowest_priority_waiting_request_for_a_higher_one(tmp_path):
    args = (
        "--enable-priority-scheduling",
        "--max-queued-requests",
        "1",
        "--max-running-requests",
        "1",
    )
    with simulated_server(tmp_path, num_pages=256, step_ms=2.0, scheduler_args=args) as address:

        async def run() -> tuple[list, list[int], grpc.aio.AioRpcError]:
            log: list = []
            async with grpc.aio.insecure_channel(address) as ch:
                s = pb_grpc.SglangSchedulerStub(ch)
                busy = asyncio.create_task(_run(s, _request("busy", [1] * 8, 300), log))
                while ("busy", "first") not in log:
                    await asyncio.sleep(0.005)
                low = asyncio.create_task(_run(s, _request("low", [2] * 8, 20, priority=1), log))
                # "low" waits behind "busy" (one running at a time): the queue is full
                while True:
                    info = await s.GetServerInfo(pb.GetServerInfoRequest())
                    if info.scheduler_info["queued_requests"] == 1:
                        break
                    await asyncio.sleep(0.005)
                high = _run(s, _request("high", [3] * 8, 20, priority=5), log)
                tokens = await asyncio.gather(busy, high)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await low
            return log, tokens, e.value

        log, tokens, evicted = asyncio.run(run())
        assert evicted.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert evicted.details() == (
            "evicted from the full queue by a request of higher priority (the limit "
            "(--max-queued-requests) is 1); retry later"
        )
        assert tokens == [300, 20]
        assert ("low", "first") not in log
        assert_idle_and_clean(stub(address))


def test_routing_key_reaches_the_policy(tmp_path):
    args = ("--schedule-policy", "routing-key", "--max-running-requests", "2")
    with simulated_server(tmp_path, num_pages=256, step_ms=2.0, scheduler_args=args) as address:

        async def run() -> list:
            log: list = []
            async with grpc.aio.insecure_channel(address) as ch:
                s = pb_grpc.SglangSchedulerStub(ch)
                keyed = asyncio.create_task(
                    _run(s, _request("keyed", [1] * 8, 600, routing_key="A"), log)
                )
                short = asyncio.create_task(_run(s, _request("short", [2] * 8, 150), log))
                while ("short", "first") not in log or ("keyed", "first") not in log:
                    await asyncio.sleep(0.005)
                # both wait for the slot "short" frees: "same" (key A, like the
                # running "keyed") goes first although "other" came first
                other = asyncio.create_task(
                    _run(s, _request("other", [3] * 8, 20, routing_key="B"), log)
                )
                await asyncio.sleep(0.02)
                same = asyncio.create_task(
                    _run(s, _request("same", [4] * 8, 20, routing_key="A"), log)
                )
                await asyncio.gather(keyed, short, other, same)
            return log

        log = asyncio.run(run())
        assert log.index(("short", "done")) < log.index(("same", "first")), log
        assert log.index(("same", "first")) < log.index(("other", "first")), log
        assert_idle_and_clean(stub(address))
