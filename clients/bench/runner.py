"""Sends a workload through a driver: Poisson arrivals at a rate, a cap on
requests in flight (a fixed concurrency), or a trace's own timestamps."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import grpc

from clients.bench.drivers import Driver
from clients.bench.records import BenchRequest, RequestRecord


@dataclass
class Run:
    records: list[RequestRecord]
    duration_s: float  # first send to last token (or error)
    # Figures of the workload beyond the records' (the multi-turn runner's
    # turns and working set), merged into the run's summary.
    extra: dict = field(default_factory=dict)


def arrival_times(
    requests: list[BenchRequest], rate: float, seed: int, replay: bool
) -> list[float]:
    """When each request becomes ready to send, seconds from the start: the
    trace's timestamps (``replay``), else Poisson arrivals at ``rate``
    requests/s (inf: all at once)."""
    if replay:
        first = min(r.arrival_s or 0.0 for r in requests)
        return [(r.arrival_s or 0.0) - first for r in requests]
    if math.isinf(rate):
        return [0.0] * len(requests)
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in requests:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def error_text(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


async def run_workload(
    driver: Driver,
    requests: list[BenchRequest],
    *,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    replay: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> Run:
    """Every request is sent once; a failed one is recorded with its error and
    the run goes on. A request's clock starts when it is sent (after waiting
    for a concurrency slot), as in SGLang's bench_serving."""
    from tqdm.auto import tqdm

    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(r.index, len(r.prompt_ids), 0.0) for r in requests]
    bar = tqdm(total=len(requests), disable=not progress, unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()

    async def one(req: BenchRequest, record: RequestRecord, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        if slots is not None:
            await slots.acquire()
        try:
            record.start_s = time.perf_counter() - t0
            await driver.send(req, record, t0)
            if not record.token_times and record.error is None:
                record.error = "the server returned no tokens"
        except Exception as e:  # recorded; one failure does not end the run
            record.error = error_text(e)
        finally:
            if slots is not None:
                slots.release()
            bar.update(1)

    times = arrival_times(requests, rate, seed, replay)
    try:
        await asyncio.gather(
            *(one(q, r, at) for q, r, at in zip(requests, records, times, strict=True))
        )
    finally:
        bar.close()
    ends = [r.token_times[-1] for r in records if r.token_times]
    duration = max(ends, default=time.perf_counter() - t0)
    return Run(records, duration)
