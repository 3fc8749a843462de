"""SubscribeKvEvents never touches its gRPC context once the call is over
(issue 27, second hardening round). A cancelled call's response generator
may be closed after gRPC freed the call; its ``finally:`` read
``context.peer()``, and grpc.aio's context then dereferences the freed call:
the API process (all of `radixserve serve`) died with a segfault in cygrpc
under a few thousand garbage calls (5 rounds of 4,060 with tracing on)."""

from __future__ import annotations

import asyncio
import contextlib

from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_service.api.admin import AdminRpcs
from scheduler_service.api.core_client import CoreClient
from scheduler_service.config import ServiceConfig


class _Context:
    """Like grpc.aio's servicer context: not to be touched after its call ended."""

    def __init__(self) -> None:
        self.ended = False
        self.touched_after_end: list[str] = []

    def peer(self) -> str:
        if self.ended:
            self.touched_after_end.append("peer")
        return "ipv4:127.0.0.1:5555"


def test_a_subscription_closed_after_its_call_ended_leaves_the_context_alone():
    async def run() -> list[str]:
        admin = AdminRpcs(CoreClient(ServiceConfig()), model=None)
        context = _Context()
        responses = admin.kv_events(cpb.SubscribeKvEventsRequest(), context)
        waiting = asyncio.ensure_future(responses.__anext__())
        await asyncio.sleep(0.05)  # subscribed: waiting for events
        context.ended = True  # the client went away; gRPC freed the call
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await responses.aclose()
        return context.touched_after_end

    assert asyncio.run(run()) == []
