"""The storms of the floods phase: cancel-and-resubmit rounds, FlushCache and
GetLoads calls, and KV event subscribers that never read (the API process's
memory watched)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
from hardening_load import Probe, ProbeLoop
from hardening_report import Row
from hardening_system import Deployment, Tree
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc


def cancel_storm(dep: Deployment, probe: Probe, quiet_s: float, rounds: int) -> Row:
    """Each round: a streamed Generate cancelled after its first chunk, and
    the same request id sent again at once (it must be served)."""
    codes: Counter[str] = Counter()
    samples: list[str] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        rid = f"storm-{k % 8}"
        ids = [7 + k % 50] * 40
        req = pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True),
            stream=True,
        )
        call = dep.stub.Generate(req, timeout=120)
        with contextlib.suppress(grpc.RpcError, StopIteration):
            next(iter(call))
        call.cancel()
        again = pb.GenerateRequest()
        again.CopyFrom(req)
        again.sampling_params.max_new_tokens = 2
        try:
            list(dep.stub.Generate(again, timeout=120))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
            with lock:
                if len(samples) < 3:
                    samples.append(f"{code}: {e.details()}")
        with lock:
            codes[code] += 1

    t0 = time.monotonic()

    def lane(t: int) -> None:
        # a lane's rounds share its request id and run one after another
        for k in range(t, rounds, 8):
            one(k)

    with ProbeLoop(probe) as loop, ThreadPoolExecutor(8) as pool:
        list(pool.map(lane, range(8)))
    wall = time.monotonic() - t0
    problems = [f"resubmit: {s}" for s in samples] + [f"probe: {e}" for e in loop.errors[:3]]
    return Row(
        "floods",
        f"cancel-and-resubmit storm: {rounds} rounds, 8 at a time, 8 request ids (cancel after "
        "the first chunk, the same id again at once)",
        f"resubmits {dict(codes)} in {wall:.0f} s; {loop.summary(quiet_s)}",
        not problems and codes["OK"] == rounds,
        problems,
        {"rounds": rounds, "codes": dict(codes)},
    )


def admin_storm(dep: Deployment, probe: Probe, quiet_s: float) -> Row:
    codes: Counter[str] = Counter()

    def call(k: int) -> str:
        try:
            if k % 20 == 0:
                dep.stub.FlushCache(cpb.FlushCacheRequest(timeout_s=1), timeout=30)
            else:
                dep.stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=30)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    t0 = time.monotonic()
    with ProbeLoop(probe) as loop, ThreadPoolExecutor(16) as pool:
        for code in pool.map(call, range(2000)):
            codes[code] += 1
    wall = time.monotonic() - t0
    problems = [f"{n} x {c}" for c, n in codes.items() if c != "OK"]
    problems += [f"probe: {e}" for e in loop.errors[:3]]
    return Row(
        "floods",
        "FlushCache and GetLoads storm: 100 FlushCache + 1900 GetLoads(all), 16 at a time",
        f"{dict(codes)} in {wall:.1f} s ({2000 / wall:.0f} calls/s); {loop.summary(quiet_s)}",
        not problems,
        problems,
        {"calls": 2000, "wall_s": round(wall, 1)},
    )


def silent_subscribers(
    dep: Deployment,
    probe: Probe,
    quiet_s: float,
    rng: random.Random,
    vocab: int,
    subscribers: int = 50,
    hold_s: float = 60.0,
) -> Row:
    """``subscribers`` SubscribeKvEvents calls, each on a channel of its own,
    never read, held while fresh prompts make KV events; the API process's
    RSS is watched."""

    def api_rss() -> int:
        tree = Tree.read(dep.serve.pid)
        return next(p.rss for p in tree.procs if tree.roles[p.pid] == "api")

    rss0 = api_rss()
    channels = [grpc.insecure_channel(dep.address) for _ in range(subscribers)]
    calls = [
        pb_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
        for ch in channels
    ]
    peak, t0, made = rss0, time.monotonic(), 0
    with ProbeLoop(probe) as loop:
        while time.monotonic() - t0 < hold_s:
            ids = [rng.randrange(100, vocab) for _ in range(256)]
            req = pb.GenerateRequest(
                request_id=f"kv-{made}",
                tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(max_new_tokens=2),
            )
            list(dep.stub.Generate(req, timeout=300))
            made += 1
            peak = max(peak, api_rss())
    for c in calls:
        c.cancel()
    for ch in channels:
        ch.close()
    time.sleep(2.0)
    rss1 = api_rss()
    grew = (peak - rss0) / 2**20
    problems = [f"probe: {e}" for e in loop.errors[:3]]
    if grew > 200:
        problems.append(
            f"the API process grew {grew:.0f} MiB with {subscribers} silent subscribers"
        )
    return Row(
        "floods",
        f"{subscribers} SubscribeKvEvents subscribers that never read, held {hold_s:.0f} s "
        f"while {made} fresh 256-token prompts made KV events",
        f"API RSS {rss0 / 2**20:.0f} MiB -> peak {peak / 2**20:.0f} -> {rss1 / 2**20:.0f} "
        f"after they left; {loop.summary(quiet_s)}",
        not problems,
        problems,
        {"rss_mib": [round(rss0 / 2**20), round(peak / 2**20), round(rss1 / 2**20)]},
    )
