"""lpm starvation benchmark (a program): TTFT under lpm with and without aging.

The load of issue 19: ``--streams`` closed-loop streams on a pool of
``--num-pages`` pages (simulated worker, every step ``--step-ms``); half the
streams send prompts sharing a long prefix (cached after the first), the
others short unique ones. Each stream sends its next request when the last
one is done. Without aging, lpm admits the prefix-matched prompts first whenever
one waits, so an unmatched one can wait for as long as they keep coming.
Each ``--lpm-max-wait`` value (0: aging off, the old behaviour) gets a fresh
server and the same seeded workload for ``--duration`` seconds; TTFT is from
sending the request to its first token.

    python benchmarks/lpm_starvation.py --lpm-max-wait 0 0.5 1 2 --duration 30

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent
VOCAB = 32000


@contextmanager
def started(args: list[str], tmp: Path, name: str):
    port_file = tmp / f"{name}.port"
    with open(tmp / f"{name}.log", "w") as log:
        proc = subprocess.Popen(
            [*args, "--port", "0", "--port-file", str(port_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} failed: {(tmp / f'{name}.log').read_text()}")
            time.sleep(0.1)
        yield int(port_file.read_text())
    finally:
        proc.terminate()
        proc.wait(30)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def drive(address: str, args: argparse.Namespace) -> list[tuple[bool, float]]:
    """(shared prefix?, TTFT seconds) of every request that got a first token."""
    rng = random.Random(args.seed)
    prefix = [rng.randrange(VOCAB) for _ in range(args.prefix_len)]
    out: list[tuple[bool, float]] = []
    end = time.monotonic() + args.duration
    counter = 0

    async def stream(s: pb_grpc.SglangSchedulerStub, i: int) -> None:
        nonlocal counter
        local = random.Random(args.seed * 1000 + i)
        while time.monotonic() < end:
            counter += 1
            shared = i % 2 == 0  # half the streams send prompts with the shared prefix
            if shared:
                ids = [*prefix, *(local.randrange(VOCAB) for _ in range(8))]
            else:
                ids = [local.randrange(VOCAB) for _ in range(local.randint(3, 32))]
            req = pb.GenerateRequest(
                request_id=f"s{i}-{counter}",
                tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True
                ),
                stream=True,
            )
            sent = time.perf_counter()
            first = None
            async for r in s.Generate(req, timeout=600):
                if first is None and r.chunk.token_ids:
                    first = time.perf_counter() - sent
            if first is not None:
                out.append((shared, first))

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        await asyncio.gather(*(stream(s, i) for i in range(args.streams)))
    return out


def summary(ttfts: list[float]) -> dict:
    return {
        "n": len(ttfts),
        "median_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "p99_ms": round(percentile(ttfts, 0.99) * 1000, 1),
        "max_ms": round(max(ttfts, default=float("nan")) * 1000, 1),
    }


def run_one(max_wait: float, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="lpm-") as d, ExitStack() as stack:
        tmp = Path(d)
        worker = [str(BIN / "radixserve-worker"), "--model", "simulated", "--log-level", "warning"]
        worker += ["--simulated-step-ms", str(args.step_ms), "--num-pages", str(args.num_pages)]
        wport = stack.enter_context(started(worker, tmp, "worker"))
        sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
        sched += ["--schedule-policy", "lpm", "--lpm-max-wait", str(max_wait)]
        sched += ["--log-level", "warning"]
        port = stack.enter_context(started(sched, tmp, "scheduler"))
        results = asyncio.run(drive(f"127.0.0.1:{port}", args))
    return {
        "lpm_max_wait_s": max_wait,
        "all": summary([t for _, t in results]),
        "shared_prefix": summary([t for shared, t in results if shared]),
        "unshared": summary([t for shared, t in results if not shared]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lpm-max-wait", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--num-pages", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rows = []
    print(
        f"{'max wait s':>10} {'class':>14} {'n':>6} {'median ms':>10} {'p99 ms':>10} {'max ms':>10}"
    )
    for value in args.lpm_max_wait:
        row = run_one(value, args)
        rows.append(row)
        for cls in ("all", "shared_prefix", "unshared"):
            s = row[cls]
            print(
                f"{value:>10g} {cls:>14} {s['n']:>6} {s['median_ms']!s:>10} {s['p99_ms']:>10} "
                f"{s['max_ms']:>10}",
                flush=True,
            )
    print(json.dumps({"args": vars(args), "runs": rows}))


if __name__ == "__main__":
    main()
