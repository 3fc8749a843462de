"""AbortRequest.reason is the message the core finishes the request with
(the abort its log line and trace record), "aborted by the client" when the
client gives none; the aborted stream ends as SGLang's does. Driven through
the public gRPC API in-process, the core a PipeCore."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request


def test_the_abort_reason_reaches_the_core_as_the_requests_abort_message():
    async def run() -> None:
        async with api_in_process() as api:
            for rid, reason, expected in (
                ("given", "the user closed the tab", "the user closed the tab"),
                ("unset", "", "aborted by the client"),
            ):
                call = api.stub.Generate(generate_request(rid))
                (s,) = await api.submitted()
                ack = await api.stub.Abort(pb.AbortRequest(request_id=rid, reason=reason))
                assert ack.success
                abort = await api.core.receive_kind(ipc.Abort)
                assert abort.rids == [s.rid] and abort.reason == expected
                call.cancel()

    asyncio.run(run())
