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
    python benchmarks/worker_decode_cpu.py --batch 1 16 --threads 2 --ab-chain-team 3

``--ab-linear N``: each batch size N times with the C linear for steps of
few rows and N times with oneDNN for every step, alternating (the same
packed weights; models/cpu_linear.SKINNY_MAX_ROWS set to 0 for oneDNN).
``--kernels``: the small ops' implementation (auto: C on the CPU; torch).

``--kv-cache-dtype``: the worker's (auto; fp8_e4m3: the fp8 cache, which the
C decode kernel reads through its e4m3 table). ``--ab-kv-fp8 N``: each batch
size N times on a worker with the float cache and N times on one with the
fp8 cache, alternating.

``--ab-chain-team N``: each batch size N times with the C decode chain's team
path (one OpenMP region a step; GGUF models) and N times op by op.

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
from collections.abc import Callable
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
    p.add_argument("--ab-chain-team", type=int, default=0, metavar="ROUNDS")
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
    if args.ab_chain_team:
        ab_chain_team(worker, args)
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


def alternate(args, rounds: int, sides: dict[str, Callable[[int], dict]], what: str) -> None:
    """Each batch size ``rounds`` times on each side (a side: batch -> measure's
    dict), alternating; prints medians of wall and CPU ms per step and the
    ratio of the second side to the first."""
    first, second = sides
    report = []
    for b in args.batch:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, run in sides.items():
                runs[side].append(run(b))
        row: dict = {"batch": b}
        for unit in ("ms_per_step", "cpu_ms_per_step"):
            a = statistics.median(r[unit] for r in runs[first])
            z = statistics.median(r[unit] for r in runs[second])
            row[unit] = {first: round(a, 2), second: round(z, 2), "ratio": round(z / a, 3)}
        w, c = row["ms_per_step"], row["cpu_ms_per_step"]
        print(
            f"batch {b}: {first} {w[first]:.1f} ms, {second} {w[second]:.1f} ms per {what} "
            f"({second}/{first} {w['ratio']:.2f}); CPU {c[first]:.1f} vs {c[second]:.1f} ms "
            f"({c['ratio']:.2f})",
            flush=True,
        )
        report.append(row)
    print(json.dumps(report))


def ab_toggle(worker, args, rounds: int, labels: tuple[str, str], use: Callable[[bool], None]):
    """``alternate`` between ``use(True)`` (labels[0]) and ``use(False)`` on one
    worker, ``use(True)`` again at the end."""

    def side(on: bool) -> Callable[[int], dict]:
        def run(b: int) -> dict:
            use(on)
            return measure(worker.runner, b, args)

        return run

    try:
        alternate(args, rounds, {labels[0]: side(True), labels[1]: side(False)}, "decode step")
    finally:
        use(True)


def ab_decode_kernel(worker, args) -> None:
    attn = worker.runner.compute.attn
    kernel = attn.decode_kernel
    if kernel is None:
        raise SystemExit("the CPU decode kernel is not available here")
    ab_toggle(worker, args, args.ab_decode_kernel, ("kernel", "torch"),
              lambda on: setattr(attn, "decode_kernel", kernel if on else None))  # fmt: skip


def ab_kv_fp8(worker, fp8, args) -> None:
    sides = {
        "float": lambda b: measure(worker.runner, b, args),
        "fp8": lambda b: measure(fp8.runner, b, args),
    }
    alternate(args, args.ab_kv_fp8, sides, "decode step")


def ab_linear(worker, args) -> None:
    small = cpu_linear.SKINNY_MAX_ROWS
    ab_toggle(worker, args, args.ab_linear, ("C", "oneDNN"),
              lambda on: setattr(cpu_linear, "SKINNY_MAX_ROWS", small if on else 0))  # fmt: skip


def ab_chain_team(worker, args) -> None:
    chain = worker.runner.compute.model.decode_chain
    if chain is None:
        raise SystemExit("the C decode chain does not run this model here")
    ab_toggle(worker, args, args.ab_chain_team, ("team", "op-by-op"),
              lambda on: setattr(chain, "use_team", on))  # fmt: skip


if __name__ == "__main__":
    main()
