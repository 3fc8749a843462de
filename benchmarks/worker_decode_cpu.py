"""The worker's decode step on the CPU, in process (a program, not a test):
the default model, ``--batch`` requests of ``--context`` prompt tokens
prefilled, then ``--steps`` decode steps timed one by one; prints the
median ms per step per batch size. ``--profile`` adds torch's profiler table
of one batch size's steps (where the time goes, by op). ``--ab-decode-kernel
N`` measures each batch size N times with the CPU decode kernel and N times
without it (torch's gather and SDPA), alternating, and prints the ratio.

    python benchmarks/worker_decode_cpu.py --batch 1 16 32 --context 320 --threads 1
    python benchmarks/worker_decode_cpu.py --batch 1 16 32 --ab-decode-kernel 3
    python benchmarks/worker_decode_cpu.py --batch 16 --shared-prefix 256 --groups 4
    python benchmarks/worker_decode_cpu.py --batch 16 --temperature 1.0 --profile
    python benchmarks/worker_decode_cpu.py --batch 1 16 32 --threads 2 --ab-linear 3
    python benchmarks/worker_decode_cpu.py --batch 1 16 --threads 2 --kernels torch
    python benchmarks/worker_decode_cpu.py --batch 1 16 32 --ab-kv-fp8 3

``--ab-linear N``: each batch size N times with the C linear for steps of
few rows and N times with oneDNN for every step, alternating (the same
packed weights; models/cpu_linear.SKINNY_MAX_ROWS set to 0 for oneDNN).
``--kernels``: the small ops' implementation (auto: C on the CPU; torch).

``--kv-cache-dtype``: the worker's (auto; fp8_e4m3: the fp8 cache, which the
C decode kernel reads through its e4m3 table). ``--ab-kv-fp8 N``: each batch
size N times on a worker with the float cache and N times on one with the
fp8 cache, alternating.

``--temperature T``: every request samples at T (the sampler's draw path)
instead of greedy decoding.

``--shared-prefix N --groups G``: request i belongs to group i % G (so a
group's rows are not next to each other in the batch); its prompt starts
with its group's N tokens, and all but the group's first request join one
step later and read that prefix from the first one's pages, as they would
from the radix cache. The rest of each prompt is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from worker_service.config import WorkerConfig
from worker_service.models import cpu_linear
from worker_service.sampling.params import SamplingParams
from worker_service.worker import build_worker


def requests(
    batch: int, context: int, steps: int, shared: int, groups: int, temperature: float = 0.0
) -> list[DriverRequest]:
    reqs = []
    sampling = SamplingParams(temperature=temperature)
    for i in range(batch):
        own = [(7 * i + j) % 40000 + 100 for j in range(context)]
        if not shared:
            reqs.append(DriverRequest(own, steps + 1, sampling=sampling))
            continue
        g = i % groups
        prefix = [(13 * g + j) % 40000 + 41000 for j in range(shared)]
        leader = i < groups
        reqs.append(
            DriverRequest(
                prefix + own[: max(1, context - shared)],
                steps + 1,
                arrive=0 if leader else 1,
                share_from=None if leader else g,
                sampling=sampling,
            )
        )
    return reqs


def measure(runner, batch: int, args: argparse.Namespace, profile: bool = False) -> dict:
    """Median ms per decode step of ``batch`` requests shaped by ``args``
    (context, steps, page_size, shared_prefix, groups)."""
    context, steps, page_size = args.context, args.steps, args.page_size
    driver = PlanDriver(runner, page_size)
    times: list[float] = []
    cpu: list[float] = []
    original = driver._apply

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    started = False

    def timed(reqs, plan):
        nonlocal started
        decode = not plan.extends and not plan.joins
        if decode and profile and not started:  # decode steps only
            prof.start()
            started = True
        t0, c0 = time.perf_counter(), time.thread_time()
        original(reqs, plan)
        if decode:
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)

    driver._apply = timed
    driver.run(requests(batch, context, steps, args.shared_prefix, args.groups, args.temperature))
    if started:
        prof.stop()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return {
        "batch": batch,
        "ms_per_step": statistics.median(times) * 1e3,
        # This thread's CPU time: with one torch thread, the step's own work,
        # less sensitive than wall time to other processes on a shared machine.
        "cpu_ms_per_step": statistics.median(cpu) * 1e3,
        "steps": len(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ab-decode-kernel", type=int, default=0, metavar="ROUNDS")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="every request samples (0: greedy)"
    )
    p.add_argument("--ab-linear", type=int, default=0, metavar="ROUNDS")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "cpu"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    p.add_argument("--ab-kv-fp8", type=int, default=0, metavar="ROUNDS")
    args = p.parse_args()
    # Every request of the largest batch holds its whole context at once (the
    # default pool is too small for batch 32 x 1024 tokens).
    per_request = -(-(args.context + args.steps + 1) // args.page_size) + 1
    config = WorkerConfig(
        model="default",
        threads=args.threads,
        page_size=args.page_size,
        kernels=args.kernels,
        num_pages=max(args.batch) * per_request + 64,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    worker = build_worker(config)
    if args.ab_kv_fp8:
        fp8 = build_worker(dataclasses.replace(config, kv_cache_dtype="fp8_e4m3"))
        ab_kv_fp8(worker, fp8, args)
        return
    if args.ab_decode_kernel:
        ab_decode_kernel(worker, args)
        return
    if args.ab_linear:
        ab_linear(worker, args)
        return
    out = []
    for b in args.batch:
        r = measure(worker.runner, b, args, args.profile)
        print(
            f"batch {b}: {r['ms_per_step']:.1f} ms per decode step "
            f"({r['cpu_ms_per_step']:.1f} ms of this thread's CPU)",
            flush=True,
        )
        out.append(r)
    print(json.dumps(out))


def ab_decode_kernel(worker, args) -> None:
    attn = worker.runner.compute.attn
    kernel = attn.decode_kernel
    if kernel is None:
        raise SystemExit("the CPU decode kernel is not available here")
    report = []
    for b in args.batch:
        sides: dict[str, list[dict]] = {"kernel": [], "torch": []}
        for _ in range(args.ab_decode_kernel):
            for side, runs in sides.items():
                attn.decode_kernel = kernel if side == "kernel" else None
                runs.append(measure(worker.runner, b, args))
        attn.decode_kernel = kernel
        row: dict = {"batch": b}
        for unit in ("ms_per_step", "cpu_ms_per_step"):
            k = statistics.median(r[unit] for r in sides["kernel"])
            t = statistics.median(r[unit] for r in sides["torch"])
            row[unit] = {"kernel": round(k, 2), "torch": round(t, 2), "ratio": round(k / t, 3)}
        w, c = row["ms_per_step"], row["cpu_ms_per_step"]
        print(
            f"batch {b}: kernel {w['kernel']:.1f} ms, torch {w['torch']:.1f} ms per decode step "
            f"(kernel/torch {w['ratio']:.2f}); CPU {c['kernel']:.1f} vs {c['torch']:.1f} ms "
            f"({c['ratio']:.2f})",
            flush=True,
        )
        report.append(row)
    print(json.dumps(report))


def ab_kv_fp8(worker, fp8, args) -> None:
    report = []
    for b in args.batch:
        sides: dict[str, list[dict]] = {"float": [], "fp8": []}
        for _ in range(args.ab_kv_fp8):
            for side, runs in sides.items():
                runs.append(measure((worker if side == "float" else fp8).runner, b, args))
        row: dict = {"batch": b}
        for unit in ("ms_per_step", "cpu_ms_per_step"):
            f = statistics.median(r[unit] for r in sides["float"])
            q = statistics.median(r[unit] for r in sides["fp8"])
            row[unit] = {"float": round(f, 2), "fp8": round(q, 2), "ratio": round(q / f, 3)}
        w, c = row["ms_per_step"], row["cpu_ms_per_step"]
        print(
            f"batch {b}: float KV {w['float']:.1f} ms, fp8 KV {w['fp8']:.1f} ms per decode step "
            f"(fp8/float {w['ratio']:.2f}); CPU {c['float']:.1f} vs {c['fp8']:.1f} ms "
            f"({c['ratio']:.2f})",
            flush=True,
        )
        report.append(row)
    print(json.dumps(report))


def ab_linear(worker, args) -> None:
    small = cpu_linear.SKINNY_MAX_ROWS
    report = []
    try:
        for b in args.batch:
            sides: dict[str, list[float]] = {"c": [], "onednn": []}
            for _ in range(args.ab_linear):
                for side, runs in sides.items():
                    cpu_linear.SKINNY_MAX_ROWS = small if side == "c" else 0
                    runs.append(measure(worker.runner, b, args)["ms_per_step"])
            c, o = statistics.median(sides["c"]), statistics.median(sides["onednn"])
            print(
                f"batch {b}: C linear {c:.1f} ms, oneDNN {o:.1f} ms per decode step "
                f"(C/oneDNN {c / o:.2f}); runs {sides}",
                flush=True,
            )
            report.append({"batch": b, "c_ms": round(c, 2), "onednn_ms": round(o, 2)})
    finally:
        cpu_linear.SKINNY_MAX_ROWS = small
    print(json.dumps(report))


if __name__ == "__main__":
    main()
