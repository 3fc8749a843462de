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

With ``--tracing off on`` each configuration runs with tracing off and with
every request traced (OTLP over gRPC to a counting receiver in its own
process, sampler always_on), alternating, to show what tracing costs.

The last line is one JSON object. Example:

    python benchmarks/overlap.py --step-ms 10 2 --depths 1 0 --batch 256 --runs 3
    python benchmarks/overlap.py --step-ms 10 --depths 2 --tracing off on --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
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
ROOT = Path(__file__).resolve().parent.parent
STREAM = True


def simulated_worker(step_ms: float) -> list[str]:
    """The command line of a simulated worker whose every step takes ``step_ms``."""
    return [
        str(BIN / "radixserve-worker"),
        *("--model", "simulated", "--simulated-step-ms", str(step_ms)),
        *("--log-level", "warning"),
    ]


@contextmanager
def started(args: list[str], tmp: Path, name: str, env: dict | None = None, pids=None):
    port_file = tmp / f"{name}.port"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [*args, "--port", "0", "--port-file", str(port_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    if pids is not None:
        pids[name] = proc.pid
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    out = {"client": time.process_time()}
    pids = dict(pids)
    if "api" in pids:  # the core process: the API process's spawned child
        api = pids["api"]
        for child in Path(f"/proc/{api}/task/{api}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids["core"] = int(child)
    for name, pid in pids.items():
        try:
            out[name] = cpu_seconds(pid)
        except OSError:
            out[name] = 0.0
    return out


async def drive(
    address: str, batch: int, warmup_s: float, duration_s: float, stub, pids: dict
) -> dict:
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
        before, cpu0, t0 = server_info(stub), cpu_of(pids), time.perf_counter()
        counting = True
        await asyncio.sleep(duration_s)
        counting = False
        after, cpu1, wall = server_info(stub), cpu_of(pids), time.perf_counter() - t0
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
        # cores busy in each process over the window (/proc; the API process
        # is the scheduler's main process, the core process is its child)
        **{f"{name}_cores": (cpu1[name] - cpu0[name]) / wall for name in cpu0},
    }


@contextmanager
def otlp_receiver(tmp: Path):
    """A span-counting OTLP receiver in its own process; yields its endpoint and,
    once stopped, leaves {"spans": n, "links": m} in the dict it yields."""
    port = free_port()
    log = tmp / "otlp.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "observability.otlp_receiver", "--quiet", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    totals: dict = {}
    try:
        deadline = time.monotonic() + 30
        while "OTLP receiver on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"OTLP receiver failed: {log.read_text()}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", totals
    finally:
        proc.terminate()
        proc.wait(20)
        last = log.read_text().strip().splitlines()[-1]
        totals.update(json.loads(last) if last.startswith("{") else {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(step_ms: float, depth: int, args: argparse.Namespace, traced: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        totals: dict = {}
        pids: dict[str, int] = {}
        if traced:
            endpoint, totals = stack.enter_context(otlp_receiver(tmp))
            env.update(
                OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                OTEL_TRACES_SAMPLER="always_on",
            )
        wport = stack.enter_context(
            started(
                simulated_worker(step_ms),
                tmp,
                "worker",
                env,
                pids,
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
        port = stack.enter_context(started(sched, tmp, "api", env, pids))
        address = f"127.0.0.1:{port}"
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
        result = asyncio.run(drive(address, args.batch, args.warmup, args.duration, stub, pids))
    if traced:  # the services flushed their spans as they stopped
        result["spans"] = totals.get("spans", 0)
        result["links"] = totals.get("links", 0)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[10.0, 2.0])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--tracing",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="run each configuration with tracing off and/or on (alternating)",
    )
    args = p.parse_args()
    results = {}
    for step_ms in args.step_ms:
        for depth in args.depths:
            runs: dict[str, list[dict]] = {mode: [] for mode in args.tracing}
            for _ in range(args.runs):
                for mode in args.tracing:
                    runs[mode].append(run_one(step_ms, depth, args, traced=mode == "on"))
            for mode, got in runs.items():
                r = {k: statistics.median(x[k] for x in got) for k in got[0]}
                r["busy_fraction_runs"] = [round(x["busy_fraction"], 4) for x in got]
                key = f"T{step_ms:g}ms_depth{depth}" + ("_traced" if mode == "on" else "")
                results[key] = r
                spans = f"  spans {r['spans']:.0f}" if mode == "on" else ""
                print(
                    f"T={step_ms:5.1f} ms depth={depth} "
                    f"({'no overlap' if depth == 0 else 'overlap'}, tracing {mode}): "
                    f"worker busy {r['busy_fraction']:6.1%} (runs {r['busy_fraction_runs']})  "
                    f"steps/s {r['steps_per_s']:6.1f}  "
                    f"core CPU/step {r['core_cpu_ms_per_step']:5.2f} ms  "
                    f"client tokens/s {r['client_tokens_per_s']:8.0f}  "
                    f"API process {r['api_cores']:4.2f} cores  client {r['client_cores']:4.2f}"
                    f"{spans}",
                    flush=True,
                )
            if len(runs) == 2:
                off = results[f"T{step_ms:g}ms_depth{depth}"]["busy_fraction"]
                on = results[f"T{step_ms:g}ms_depth{depth}_traced"]["busy_fraction"]
                print(f"  tracing on - off: {100 * (on - off):+.1f} points of busy fraction")
    print(json.dumps({"batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
