"""SubscribeKvEvents: one sequence of event batches for the whole scheduler,
fanned out to every subscriber, each batch carrying the engine's load; while
no event comes, a load-only heartbeat every second that repeats the last
sequence the stream sent. Before the stream's first event batch, heartbeats
(numbered 0) go only to a subscriber that asked for them
(``load_records_before_first_batch``): an older one would take the batch
numbered 0 for a duplicate. The record is GetLoads' figures
(convert/loads.py); its telemetry rides the heartbeats and the first record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service import ipc
from scheduler_service.api.convert.kv_events import kv_event
from scheduler_service.api.convert.loads import engine_load
from scheduler_service.api.core_client import CoreClient

HEARTBEAT_S = 1.0
QUEUE_LIMIT = 10_000  # a subscriber that falls this far behind is cut off


class KvEventPublisher:
    def __init__(
        self, core: CoreClient, load_of: Callable[[ipc.Load | None], pb.SchedulerLoad]
    ) -> None:
        self.core = core
        self.load_of = load_of  # a core snapshot as GetLoads reports it, every section
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

    async def subscribe(
        self, *, records_before_first_batch: bool
    ) -> AsyncIterator[cpb.KvEventBatch]:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        sample = 0
        sent: int | None = None  # the last sequence this stream sent
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), HEARTBEAT_S)
                except TimeoutError:
                    item = "heartbeat"
                if item is None:
                    return
                if item == "heartbeat":
                    if self.core.load is None or (sent is None and not records_before_first_batch):
                        continue
                    sample += 1
                    yield cpb.KvEventBatch(
                        sequence_number=sent or 0,
                        timestamp=time.time(),
                        load=engine_load(
                            self.load_of(self.core.load), sample, load_only=True, telemetry=True
                        ),
                    )
                    continue
                seq, ts, msgs, load = item
                sample += 1
                sent = seq
                yield cpb.KvEventBatch(
                    sequence_number=seq,
                    timestamp=ts,
                    events=msgs,
                    load=engine_load(
                        self.load_of(load), sample, load_only=False, telemetry=sample == 1
                    ),
                )
        finally:
            self._subscribers.discard(q)
