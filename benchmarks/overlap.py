"""Overlap benchmark (a program): the whole system on loopback with the
simulated model's worker, every step taking a fixed time T.

For each T and overlap depth (0 = overlap off; 1 = plan N+1 sent before
result N arrives; 2 = one plan more ahead): start radixserve-worker
(simulated, --simulated-step-ms T) and radixserve-scheduler, keep ``--batch``
streams decoding, and measure over ``--duration`` seconds, ``--runs`` times
(medians reported):

- the worker's busy fraction: time inside steps / wall time (from the
  scheduler's accounting of every step's forward and idle time);
- the scheduler core's CPU time per step;
- the tokens per second the clients receive.

The last line is one JSON object. Example:

    python benchmarks/overlap.py --step-ms 10 2 --depths 1 0 --batch 256 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
STREAM = True


@contextmanager
def started(args: list[str], tmp: Path, name: str):
    port_file = tmp / f"{name}.port"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [*args, "--port", "0", "--port-file", str(port_file)], stdout=log, stderr=subprocess.STDOUT
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
        proc.wait(20)
        log.close()


def server_info(stub: pb_grpc.SglangSchedulerStub) -> dict:
    info = stub.GetServerInfo(pb.GetServerInfoRequest()).scheduler_info
    return {k: info[k] for k in ("worker_steps", "worker_busy_ms", "worker_idle_ms", "core_cpu_s")}


async def drive(address: str, batch: int, warmup_s: float, duration_s: float, stub) -> dict:
    received = 0
    counting = False

    async def one(s, i: int) -> None:
        nonlocal received
        req = pb.GenerateRequest(
            request_id=f"b{i}",
            tokenized=pb.TokenizedInput(input_ids=[(i * 31 + j) % 32000 for j in range(16)]),
            sampling_params=pb.SamplingParams(
                temperature=0.0, max_new_tokens=1_000_000, ignore_eos=True
            ),
            stream=STREAM,
        )
        async for r in s.Generate(req):
            if counting:
                received += len(r.chunk.token_ids)

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        tasks = [asyncio.create_task(one(s, i)) for i in range(batch)]
        await asyncio.sleep(warmup_s)
        before, t0 = server_info(stub), time.perf_counter()
        counting = True
        await asyncio.sleep(duration_s)
        counting = False
        after, wall = server_info(stub), time.perf_counter() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steps = after["worker_steps"] - before["worker_steps"]
    busy = after["worker_busy_ms"] - before["worker_busy_ms"]
    idle = after["worker_idle_ms"] - before["worker_idle_ms"]
    return {
        "busy_fraction": busy / (wall * 1e3),
        "busy_over_busy_plus_idle": busy / max(busy + idle, 1e-9),
        "steps_per_s": steps / wall,
        "core_cpu_ms_per_step": 1e3 * (after["core_cpu_s"] - before["core_cpu_s"]) / max(steps, 1),
        "client_tokens_per_s": received / wall,
    }


def run_one(step_ms: float, depth: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        wport = stack.enter_context(
            started(
                [
                    str(BIN / "radixserve-worker"),
                    "--model",
                    "simulated",
                    "--simulated-step-ms",
                    str(step_ms),
                    "--log-level",
                    "warning",
                ],
                tmp,
                "worker",
            )
        )
        sched = [
            str(BIN / "radixserve-scheduler"),
            "--worker",
            f"grpc://127.0.0.1:{wport}",
            "--max-running-requests",
            str(args.batch),
            "--log-level",
            "warning",
            "--overlap-depth",
            str(depth),
        ]
        if depth == 0:
            sched.append("--disable-overlap")
        port = stack.enter_context(started(sched, tmp, "scheduler"))
        address = f"127.0.0.1:{port}"
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
        return asyncio.run(drive(address, args.batch, args.warmup, args.duration, stub))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[10.0, 2.0])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    results = {}
    for step_ms in args.step_ms:
        for depth in args.depths:
            runs = [run_one(step_ms, depth, args) for _ in range(args.runs)]
            r = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            r["busy_fraction_runs"] = [round(x["busy_fraction"], 4) for x in runs]
            results[f"T{step_ms:g}ms_depth{depth}"] = r
            print(
                f"T={step_ms:5.1f} ms depth={depth} ({'no overlap' if depth == 0 else 'overlap'}): "
                f"worker busy {r['busy_fraction']:6.1%} (runs {r['busy_fraction_runs']})  "
                f"steps/s {r['steps_per_s']:6.1f}  "
                f"core CPU/step {r['core_cpu_ms_per_step']:5.2f} ms  "
                f"client tokens/s {r['client_tokens_per_s']:8.0f}",
                flush=True,
            )
    print(json.dumps({"batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
