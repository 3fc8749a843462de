"""Bytes that do not parse as the method's request message end the call with
INVALID_ARGUMENT and a message a person can act on (not gRPC's UNKNOWN with
a Python class name), are logged and counted, and reach no core
(api/decode_guard.py, in front of the servicer as server.py puts it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from structlog.testing import capture_logs

from scheduler_service.api.server import SERVICE_NAME
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish

GARBAGE = b"\xff\xff\xff\xff\x0f\x00garbage"  # a truncated varint: no message parses from it

METHODS = [
    ("Generate", True, "sglang.grpc.scheduler.GenerateRequest"),
    ("Abort", False, "sglang.grpc.scheduler.AbortRequest"),
    ("GetLoads", False, "sglang.grpc.scheduler.GetLoadsRequest"),
    ("SubscribeKvEvents", True, "smg.grpc.common.SubscribeKvEventsRequest"),
]


async def _send_raw(channel: grpc.aio.Channel, method: str, streaming: bool) -> None:
    path = f"/{SERVICE_NAME}/{method}"
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(path, request_serializer=lambda b: b, response_deserializer=bytes)(
        GARBAGE, timeout=5
    )
    if streaming:
        async for _ in call:
            pass
    else:
        await call


@pytest.mark.parametrize(("method", "streaming", "message"), METHODS)
def test_undecodable_bytes_are_invalid_argument_logged_and_counted(method, streaming, message):
    async def run() -> None:
        async with api_in_process() as api:
            with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as e:
                await _send_raw(api.channel, method, streaming)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            details = e.value.details()
            assert details.startswith(f"the request ({len(GARBAGE)} bytes) does not parse as ")
            assert f"a {message} message" in details and "class" not in details
            refused = [x for x in logs if x["event"] == "undecodable request refused"]
            assert [(x["method"], x["bytes"]) for x in refused] == [
                (f"/{SERVICE_NAME}/{method}", len(GARBAGE))
            ]
            assert api.metrics.errors["INVALID_ARGUMENT"] == 1
            assert await api.core.nothing_sent()
            # and the server goes on serving
            call = api.stub.Generate(generate_request("after", stream=False))
            (s,) = await api.submitted()
            api.core.say(finish(s.rid, 4))
            assert [list(r.complete.output_ids) async for r in call] == [[4]]

    asyncio.run(run())


def test_a_good_request_passes_the_guard_untouched():
    async def run() -> None:
        async with api_in_process() as api:
            reply = await api.stub.Abort(pb.AbortRequest(request_id="nobody", reason="x"))
            assert reply.success and reply.message == "Request nobody aborted"
            loads = await api.stub.GetLoads(pb.GetLoadsRequest(include=["core"]))
            assert loads.dp_rank_count == 1
            assert api.metrics.errors["INVALID_ARGUMENT"] == 0

    asyncio.run(run())
