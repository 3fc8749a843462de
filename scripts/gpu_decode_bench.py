"""Decode throughput of a worker at several batch sizes (a program, not a test).

Prefills ``batch`` requests of ``--context`` random tokens, then times
``--steps`` decode steps of the whole batch through the worker's executor
(plan in, tokens out: attention, sampling and bookkeeping included), for each
attention backend asked for. Prints one line per (backend, batch) and a JSON
line at the end. Runs on CPU too (small settings) so it can be exercised
without a GPU.

    python scripts/gpu_decode_bench.py --device cuda --backends flashinfer,torch
    python scripts/gpu_decode_bench.py --device cpu --backends torch --batches 1,4 \
        --context 64 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from worker_service.config import WorkerConfig
from worker_service.engine import build_worker
from worker_service.plan import ExtendSpec, JoinSpec, LogprobSpec, Mode, Plan, SamplingSpec

GREEDY = SamplingSpec(temperature=0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(args: argparse.Namespace, backend: str, batch: int) -> dict[str, float]:
    page_size = args.page_size
    pages_per_req = -(-(args.context + args.steps + 1) // page_size)
    cfg = WorkerConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=backend,
        page_size=page_size,
        num_pages=pages_per_req * batch + 1,
    )
    worker = build_worker(cfg)
    ex = worker.executor
    device = worker.device
    g = torch.Generator().manual_seed(0)
    tables = [list(range(i * pages_per_req, (i + 1) * pages_per_req)) for i in range(batch)]
    # Prefill in plans of at most 8 requests to bound activation memory.
    for first in range(0, batch, 8):
        plan = Plan(first + 1, Mode.PREFILL)
        for slot in range(first, min(batch, first + 8)):
            prompt = torch.randint(0, worker.vocab_size, (args.context,), generator=g).tolist()
            plan.joins.append(JoinSpec(slot, f"r{slot}", GREEDY, LogprobSpec(), len(prompt), []))
            plan.extends.append(ExtendSpec(slot, 0, prompt, tables[slot], True))
        assert not (r := ex.execute(plan)).error, r.error
    positions = [args.context] * batch
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        plan = Plan(10_000 + step, Mode.DECODE)
        plan.decode_slots = list(range(batch))
        plan.decode_positions = list(positions)
        plan.decode_new_pages = [0] * batch  # tables were sent whole with the prefill
        sync(device)
        t0 = time.perf_counter()
        result = ex.execute(plan)
        sync(device)
        assert not result.error, result.error
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        positions = [p + 1 for p in positions]
    step_s = statistics.median(times)
    del worker, ex
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_ms": step_s * 1e3, "tokens_per_s": batch / step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backends", default="flashinfer,torch")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()
    figures: dict[str, dict[str, float]] = {}
    for backend in args.backends.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            f = bench(args, backend, batch)
            figures[f"{backend}_b{batch}"] = f
            print(
                f"{backend:10s} batch {batch:4d}: {f['step_ms']:8.2f} ms/step  "
                f"{f['tokens_per_s']:10.1f} tokens/s",
                flush=True,
            )
    print(json.dumps({"context": args.context, "device": args.device, "figures": figures}))


if __name__ == "__main__":
    main()
