"""Soak and load program: many concurrent streams against a real server for a
long time, with random aborts and client disconnects, watching memory.

By default it starts ``radixserve serve --model simulated`` (scheduler API
process, core process, one simulated worker; each step takes ``--step-ms``)
with ``--metrics-port``; ``--server HOST:PORT`` drives a running server
instead (memory then comes from ``--metrics-ports``' process_resident_memory_bytes).

``--streams`` client loops (one asyncio process) each send request after
request until ``--duration`` is over: mixed prompt lengths (one of a few
shared system prompts plus a random question, so the radix cache is used)
and output lengths; each request either runs to completion, is aborted with
the Abort RPC after a random number of tokens, or is cancelled mid-stream
(a client disconnect). Every ``--sample-s`` seconds a table row gives the
requests done, the tokens/s received and the RSS of each server process.

At the end it waits for the server to go idle, checks running = waiting = 0
and that the page pool is back to its start (FlushCache drops the radix
cache, then GetLoads' used tokens must equal the start's), and compares each
process's RSS at ``--warmup-fraction`` of the run with the end. Exit status 1
on any RPC error, a stream whose tokens disagree with its completion, a page
leak, or RSS growth over ``--max-growth``.

    python benchmarks/soak.py --duration 10m --streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

# run as a script (like the other benchmarks), so its own directory is on sys.path
from soak_support import (
    Server,
    growth_report,
    parse_duration,
    print_row,
)

VOCAB = 32000  # the simulated model's vocabulary


class Load:
    """What the client loops saw; the sampler reads it while they run."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()  # completed / aborted / disconnected
        self.errors: Counter[str] = Counter()  # by gRPC status code
        self.mismatches = 0  # streamed tokens != what the completion says
        self.tokens = 0


def make_request(
    rng: random.Random, rid: str, prefixes: list[list[int]], args
) -> pb.GenerateRequest:
    question = [rng.randrange(VOCAB) for _ in range(rng.randint(4, args.max_question))]
    max_new = rng.choice(
        [rng.randint(1, 16), rng.randint(16, 128), rng.randint(128, args.max_output)]
    )
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=rng.choice(prefixes) + question),
        # ignore_eos: a completed request's length is then known, one more check
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True),
        stream=True,
    )


async def one_request(stub, req: pb.GenerateRequest, fate: str, cut: int, load: Load) -> None:
    """Run one stream; ``fate`` is complete, abort (Abort RPC after ``cut``
    tokens) or disconnect (cancel the call after ``cut`` tokens)."""
    call = stub.Generate(req)
    got, aborted_sent, finish = 0, False, None
    try:
        async for r in call:
            if r.HasField("chunk"):
                got += len(r.chunk.token_ids)
                load.tokens += len(r.chunk.token_ids)
            if r.HasField("complete"):
                finish = r.complete.finish_reason
                if r.complete.completion_tokens != got:
                    load.mismatches += 1
            if got >= cut and fate == "disconnect":
                call.cancel()
                load.outcomes["disconnected"] += 1
                return
            if got >= cut and fate == "abort" and not aborted_sent:
                aborted_sent = True
                await stub.Abort(pb.AbortRequest(request_id=req.request_id, reason="soak"))
    except grpc.aio.AioRpcError as e:
        load.errors[e.code().name] += 1
        return
    except asyncio.CancelledError:
        if fate == "disconnect":
            load.outcomes["disconnected"] += 1
            return
        raise
    # An abort that lands after the last token leaves a normal completion.
    if finish is None:
        load.errors["NO_COMPLETE"] += 1
    elif "abort" in str(finish).lower():
        load.outcomes["aborted"] += 1
    else:
        if fate == "complete" and got != req.sampling_params.max_new_tokens:
            load.mismatches += 1
        load.outcomes["completed"] += 1


async def client_loop(i: int, stub, prefixes, deadline: float, args, load: Load) -> None:
    rng = random.Random(args.seed * 1000 + i)
    n = 0
    while time.monotonic() < deadline:
        req = make_request(rng, f"soak-{i}-{n}", prefixes, args)
        x = rng.random()
        fate = "abort" if x < args.abort_fraction else "complete"
        if args.abort_fraction <= x < args.abort_fraction + args.disconnect_fraction:
            fate = "disconnect"
        cut = rng.randint(0, req.sampling_params.max_new_tokens)
        await one_request(stub, req, fate, cut, load)
        n += 1


async def loads(stub) -> pb.SchedulerLoad:
    return (await stub.GetLoads(pb.GetLoadsRequest(include=["core"]))).loads[0]


async def worker_steps(stub) -> tuple[float, float]:
    """(steps, busy ms) so far: how far the worker was from its own limit."""
    info = (await stub.GetServerInfo(pb.GetServerInfoRequest())).scheduler_info
    return info["worker_steps"], info["worker_busy_ms"]


async def soak(address: str, server: Server, args) -> int:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (0, 32, 128, 256, 512, 1024)]
    load = Load()
    failures: list[str] = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        await stub.FlushCache(cpb.FlushCacheRequest(timeout_s=30))
        baseline = (await loads(stub)).num_used_tokens
        steps0, busy0 = await worker_steps(stub)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        tasks = [
            asyncio.create_task(client_loop(i, stub, prefixes, deadline, args, load))
            for i in range(args.streams)
        ]
        samples: list[tuple[float, dict[str, int]]] = []
        cpu0, last_t, last_tokens, lags = time.process_time(), t0, 0, []
        names = sorted(server.rss())
        print_row(
            ["time_s", "done", "tok/s", "running", "waiting", "used_tok", *names], header=True
        )
        while not all(t.done() for t in tasks):
            t_sleep = time.monotonic()
            wait = min(args.sample_s, max(deadline - t_sleep, 1.0))
            await asyncio.sleep(wait)
            # how late the loop woke: an overloaded load generator shows here
            lags.append(time.monotonic() - t_sleep - wait)
            now, rss, ld = time.monotonic(), server.rss(), await loads(stub)
            samples.append((now - t0, rss))
            rate = (load.tokens - last_tokens) / (now - last_t)
            last_t, last_tokens = now, load.tokens
            done = sum(load.outcomes.values()) + sum(load.errors.values())
            row = [f"{now - t0:.0f}", done, f"{rate:.0f}", ld.num_running_reqs, ld.num_waiting_reqs]
            print_row([*row, ld.num_used_tokens, *(f"{rss.get(n, 0) / 2**20:.0f}M" for n in names)])
        wall = time.monotonic() - t0
        steps1, busy1 = await worker_steps(stub)
        client_cpu = (time.process_time() - cpu0) / wall
        await asyncio.gather(*tasks)

        # Idle, then the pool must be back where it started once the cache is dropped.
        idle_deadline = time.monotonic() + 60
        while (ld := await loads(stub)).num_running_reqs or ld.num_waiting_reqs:
            if time.monotonic() > idle_deadline:
                failures.append(
                    f"not idle: running {ld.num_running_reqs}, waiting {ld.num_waiting_reqs}"
                )
                break
            await asyncio.sleep(0.2)
        cached = ld.num_used_tokens
        flushed = await stub.FlushCache(cpb.FlushCacheRequest(timeout_s=30))
        after = (await loads(stub)).num_used_tokens
    if not flushed.success:
        failures.append(f"FlushCache failed: {flushed.message}")
    if after != baseline:
        failures.append(f"page leak: {after} tokens used after flush, {baseline} at the start")

    o = load.outcomes
    total = sum(o.values()) + sum(load.errors.values())
    print(f"\nduration {wall:.0f} s, streams {args.streams}, requests {total}")
    print(f"completed {o['completed']}, aborted {o['aborted']}, disconnected {o['disconnected']}")
    print(f"errors {dict(load.errors) or 0}, token-count mismatches {load.mismatches}")
    print(f"generated tokens/s {load.tokens / wall:.0f} (received by the clients)")
    lag_ms = max(lags) * 1e3
    print(f"load generator: {client_cpu:.0%} of one core, sampler wake-up lag max {lag_ms:.0f} ms")
    limit = ""  # the step time is known only for a server started here
    if not args.server and args.step_ms > 0:
        limit = f" ({args.step_ms:g} ms steps: at most {1e3 / args.step_ms:.0f}/s)"
    busy = (busy1 - busy0) / (wall * 1e3)
    print(f"worker: {(steps1 - steps0) / wall:.0f} steps/s, busy {busy:.0%} of the time{limit}")
    print(f"idle: used tokens {cached} with the cache, {after} after FlushCache (start {baseline})")
    growth_ok, lines = growth_report(samples, args.warmup_fraction * wall, args.max_growth)
    print("\n".join(lines))
    if load.errors:
        failures.append(f"RPC errors: {dict(load.errors)}")
    if load.mismatches:
        failures.append(f"{load.mismatches} streams with wrong token counts")
    if not o["completed"]:
        failures.append("no request completed")
    if not growth_ok:
        failures.append(f"RSS grew more than {args.max_growth:.0%} after warm-up")
    print("RESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument(
        "--metrics-ports",
        type=int,
        nargs="*",
        default=[],
        help="with --server: /metrics ports to read RSS from (scheduler, workers)",
    )
    p.add_argument(
        "--duration",
        type=parse_duration,
        default=parse_duration("60s"),
        help="e.g. 90, 30s, 10m, 1h",
    )
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0, help="simulated worker step time")
    p.add_argument(
        "--num-pages",
        type=int,
        default=8192,
        help="simulated worker's KV pages (16 tokens each): the cache fills and evicts",
    )
    p.add_argument("--max-question", type=int, default=256)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-fraction", type=float, default=0.2)
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with Server.open(args) as server:
        return asyncio.run(soak(server.address, server, args))


if __name__ == "__main__":
    sys.exit(main())
