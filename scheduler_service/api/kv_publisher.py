"""SubscribeKvEvents: one sequence of event batches for the whole scheduler,
fanned out to every subscriber, each batch carrying the engine's load; while
no event comes, a load-only heartbeat every second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_service import ipc
from scheduler_service.api.convert.kv_events import engine_load, kv_event
from scheduler_service.api.core_client import CoreClient
from scheduler_service.api.throughput import Throughput

HEARTBEAT_S = 1.0
QUEUE_LIMIT = 10_000  # a subscriber that falls this far behind is cut off


class KvEventPublisher:
    def __init__(self, core: CoreClient, throughput: Throughput) -> None:
        self.core = core
        self.throughput = throughput
        self.sequence = 0
        self.event_id = 0
        self._subscribers: set[asyncio.Queue] = set()
        core.on_events(self._publish)

    def _publish(self, events: list, load: ipc.Load) -> None:
        if not events or not self._subscribers:
            return
        self.sequence += 1
        msgs = []
        for e in events:
            self.event_id += 1
            msgs.append(kv_event(self.event_id, e))
        batch = (self.sequence, time.time(), msgs, load)
        for q in list(self._subscribers):
            if q.qsize() >= QUEUE_LIMIT:
                self._subscribers.discard(q)
                q.put_nowait(None)  # too slow: end its stream, it resubscribes
            else:
                q.put_nowait(batch)

    def close(self) -> None:
        """End every subscription (the server is stopping)."""
        for q in self._subscribers:
            q.put_nowait(None)
        self._subscribers.clear()

    async def subscribe(self) -> AsyncIterator[cpb.KvEventBatch]:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        sample = 0
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), HEARTBEAT_S)
                except TimeoutError:
                    item = "heartbeat"
                if item is None:
                    return
                sample += 1
                rate = self.throughput.rate()
                if item == "heartbeat":
                    if self.core.load is None:
                        continue
                    yield cpb.KvEventBatch(
                        sequence_number=self.sequence,
                        timestamp=time.time(),
                        load=engine_load(self.core.load, sample, rate, load_only=True),
                    )
                    continue
                seq, ts, msgs, load = item
                yield cpb.KvEventBatch(
                    sequence_number=seq,
                    timestamp=ts,
                    events=msgs,
                    load=engine_load(load, sample, rate, load_only=False),
                )
        finally:
            self._subscribers.discard(q)
