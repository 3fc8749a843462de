"""API-process CPU per streamed token (a program): the whole system on
loopback with the simulated model's worker (every step ``--step-ms``), and
``--batch`` streaming Generate calls through the real public gRPC API.

Over ``--duration`` seconds (after ``--warmup``), ``--runs`` times (medians):

- the API process's CPU time (/proc: user + system of all its threads, not
  the core process, its child) divided by the tokens the clients received:
  microseconds of API-process CPU per streamed token;
- the same for the core process per step;
- tokens/s received and tokens per response message (a message carries
  several tokens only when the API process or the client fell behind: the
  figure shows whether a low CPU per token came from batching).

The clients run in ``--clients`` processes of their own, so their CPU is not
the API process's. ``--profile FILE`` samples the API process with py-spy
(raw "collapsed" stacks) during the measured window of the first run.

The last line is one JSON object. Example:

    python benchmarks/api_stream_cpu.py --step-ms 2 --batch 256 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from overlap import BIN, cpu_of, server_info, simulated_worker, started
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc


def sys_seconds(pid: int) -> float:
    """System (kernel) CPU time of a process: for the API process, mostly
    socket writes (a gRPC message is a sendmsg to the client)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def client_main(address: str, first: int, count: int, conn, args: dict) -> None:
    """One client process: ``count`` streams; on "start"/"stop" it sends back
    the tokens and messages received in between."""
    asyncio.run(_client(address, first, count, conn, args))


async def _client(address: str, first: int, count: int, conn, args: dict) -> None:
    tokens = messages = 0

    async def one(stub, i: int) -> None:
        nonlocal tokens, messages
        req = pb.GenerateRequest(
            request_id=f"c{i}",
            tokenized=pb.TokenizedInput(input_ids=[(i * 31 + j) % 32000 for j in range(16)]),
            sampling_params=pb.SamplingParams(
                temperature=0.0, max_new_tokens=1_000_000, ignore_eos=True
            ),
            stream=True,
        )
        async for r in stub.Generate(req):
            tokens += len(r.chunk.token_ids)
            messages += 1

    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        tasks = [asyncio.create_task(one(stub, first + i)) for i in range(count)]
        for _ in ("start", "stop"):
            await loop.run_in_executor(None, conn.recv)
            conn.send((tokens, messages, time.process_time()))
        await loop.run_in_executor(None, conn.recv)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def measure(address: str, pids: dict, args: argparse.Namespace, profile: str | None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    per = -(-args.batch // args.clients)
    clients = []
    for k in range(args.clients):
        ours, theirs = ctx.Pipe()
        count = min(per, args.batch - k * per)
        p = ctx.Process(target=client_main, args=(address, k * per, count, theirs, {}))
        p.start()
        clients.append((p, ours))
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
    spy = None
    try:
        time.sleep(args.warmup)
        for _, c in clients:
            c.send("start")
        got0 = [c.recv() for _, c in clients]
        before, cpu0, t0 = server_info(stub), cpu_of(pids), time.perf_counter()
        sys0 = sys_seconds(pids["api"])
        if profile:
            native = bool(os.environ.get("PYSPY_NATIVE"))  # stops the process to sample
            spy = subprocess.Popen(
                [
                    str(BIN / "py-spy"),
                    "record",
                    "--pid",
                    str(pids["api"]),
                    "--format",
                    "raw",
                    "--rate",
                    "200",
                    "--duration",
                    str(int(args.duration)),
                    "--output",
                    profile,
                    "--threads",
                    *(["--native"] if native else ["--nonblocking"]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        time.sleep(args.duration)
        for _, c in clients:
            c.send("stop")
        got1 = [c.recv() for _, c in clients]
        after, cpu1, wall = server_info(stub), cpu_of(pids), time.perf_counter() - t0
        sys1 = sys_seconds(pids["api"])
        for _, c in clients:
            c.send("end")
    finally:
        for p, _ in clients:
            p.join(20)
            if p.is_alive():
                p.kill()
        if spy is not None:
            spy.wait(60)
    tokens = sum(g[0] for g in got1) - sum(g[0] for g in got0)
    messages = sum(g[1] for g in got1) - sum(g[1] for g in got0)
    client_cpu = sum(g[2] for g in got1) - sum(g[2] for g in got0)
    steps = after["worker_steps"] - before["worker_steps"]
    api_cpu = cpu1["api"] - cpu0["api"]
    return {
        "tokens_per_s": tokens / wall,
        "steps_per_s": steps / wall,
        "tokens_per_message": tokens / max(messages, 1),
        "api_us_per_token": 1e6 * api_cpu / max(tokens, 1),
        "api_cores": api_cpu / wall,
        "api_us_per_message": 1e6 * api_cpu / max(messages, 1),
        "api_system_share": (sys1 - sys0) / max(api_cpu, 1e-9),
        "core_ms_per_step": 1e3 * (cpu1["core"] - cpu0["core"]) / max(steps, 1),
        "client_cores": client_cpu / wall,
        "worker_busy_fraction": (after["worker_busy_ms"] - before["worker_busy_ms"]) / (wall * 1e3),
    }


def run_one(args: argparse.Namespace, step_ms: float, profile: str | None) -> dict:
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        pids: dict[str, int] = {}
        wport = stack.enter_context(
            started(
                simulated_worker(step_ms),
                tmp,
                "worker",
                env,
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
            *args.scheduler_args,
        ]
        port = stack.enter_context(started(sched, tmp, "api", env, pids))
        return measure(f"127.0.0.1:{port}", pids, args, profile)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[2.0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", help="py-spy raw output of the first run's window")
    p.add_argument("--scheduler-args", nargs=argparse.REMAINDER, default=[], help="passed on, last")
    args = p.parse_args()
    results = {}
    for step_ms in args.step_ms:
        got = [
            run_one(args, step_ms, args.profile if i == 0 and step_ms == args.step_ms[0] else None)
            for i in range(args.runs)
        ]
        r = {k: statistics.median(x[k] for x in got) for k in got[0]}
        r["api_us_per_token_runs"] = [round(x["api_us_per_token"], 2) for x in got]
        results[f"T{step_ms:g}ms"] = r
        print(
            f"T={step_ms:4.1f} ms batch={args.batch}: API {r['api_us_per_token']:5.2f} us/token "
            f"(runs {r['api_us_per_token_runs']}, {r['api_cores']:.2f} cores, "
            f"{r['api_system_share']:.0%} in the kernel, "
            f"{r['api_us_per_message']:.0f} us/message)  "
            f"tokens/s {r['tokens_per_s']:7.0f}  tokens/message {r['tokens_per_message']:5.2f}  "
            f"steps/s {r['steps_per_s']:6.1f}  core {r['core_ms_per_step']:5.2f} ms/step  "
            f"clients {r['client_cores']:.2f} cores  worker busy {r['worker_busy_fraction']:.1%}",
            flush=True,
        )
    print(json.dumps({"batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
