"""KV memory of a sliding-window model with and without freeing the pages
behind the window (a program, not a test; issue 32 item 4).

The scheduler core drives the in-process simulated worker shaped like
Gemma 3: of every 6 layers 5 are sliding (``--window`` tokens) and 1 is
full attention. The KV of one token in one layer is the unit of bytes
(``--layer-token-bytes``; 4096 for Gemma 3 4B: 4 KV heads x head dim 256 x
K and V x bf16), so a full page costs 1 x page_size units per full layer and
a sliding page 5 x page_size units.

1. Held: ``--requests`` requests of ``--prompt`` tokens (distinct prompts,
   ``--new`` tokens each) in pools big enough for all of them. The peak of
   the pages requests hold (free and evictable cache pages not counted) and
   its bytes, in three runs of the same process: one pool for every layer
   (the model without sliding-pool support), two pools with the freeing
   switched off (``KvManager.slide`` a no-op), and two pools with it.
2. Admitted: the same requests against a fixed KV memory budget (what one
   pool for every layer needs for ``--budget-requests`` of them): the
   largest number of requests running at once and the steps to serve them
   all, one pool versus two pools split at each ``--ratios`` (sliding pool tokens per full pool
   token, SGLang's --swa-full-tokens-ratio).

    python benchmarks/swa_memory.py [--window 1024] [--page-size 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.testing.simulated_worker import SimulatedWorker

VOCAB = 32000
LAYERS, SLIDING_LAYERS = 6, 5  # Gemma 3's pattern: 5 local layers, then 1 global


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1 + (i * 7919 + j * 104729) % (VOCAB - 1) for j in range(length)] for i in range(n)]


def run(
    args: argparse.Namespace,
    num_pages: int,
    num_swa_pages: int,
    *,
    freeing: bool = True,
) -> dict:
    """Serve every request to the end; the peak of what requests hold."""
    ps = args.page_size
    cfg = SchedulerConfig(
        page_size=ps,
        max_running_requests=args.requests,
        max_prefill_tokens=args.chunk * 4,
        chunked_prefill_size=args.chunk,
        vocab_size=VOCAB,
        eos_token_ids=frozenset({0}),
    )
    window = args.window if num_swa_pages else 0
    sched = Scheduler(cfg, num_pages, num_swa_pages=num_swa_pages, swa_window=window)
    worker = SimulatedWorker(
        num_pages,
        ps,
        VOCAB,
        check_reads=False,
        num_swa_pages=num_swa_pages,
        swa_window=window,
    )
    if not freeing:
        sched.kv.slide = lambda req: None
    sp = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    reqs = [Request(f"r{i}", p, sp) for i, p in enumerate(prompts(args.requests, args.prompt))]
    for r in reqs:
        sched.add_request(r)
    peak_full = peak_swa = peak_units = 0
    running: list[int] = []
    t0 = time.perf_counter()
    while (plan := sched.step()) is not None:
        full = sched.pool.num_used - sched.cache.evictable_pages
        swa = 0
        if sched.sliding is not None:
            s = sched.sliding
            swa = s.num_pages - 1 - s.num_free - s.tree_only
            units = ps * (full * (LAYERS - SLIDING_LAYERS) + swa * SLIDING_LAYERS)
        else:
            units = ps * full * LAYERS
        if units > peak_units:
            peak_units, peak_full, peak_swa = units, full, swa
        if plan.decodes:
            running.append(len(sched.table.running))
        sched.update(worker.execute(plan))
    unfinished = [r.rid for r in reqs if not r.finished]
    if unfinished or sched.stats.oom_aborts:
        raise RuntimeError(f"not served: {unfinished[:3]}, oom aborts {sched.stats.oom_aborts}")
    return {
        "full_pages": peak_full,
        "sliding_pages": peak_swa,
        "pages": peak_full + peak_swa,
        "bytes": peak_units * args.layer_token_bytes,
        "max_running": max(running),
        "mean_running": round(sum(running) / len(running), 1),
        "retractions": sched.stats.retractions,
        "steps": sched.stats.steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--layer-token-bytes", type=int, default=4096)
    p.add_argument("--budget-requests", type=int, default=16)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.8, 0.25, 0.15])
    args = p.parse_args()
    ps = args.page_size
    per_req = -(-(args.prompt + args.new) // ps) + 1
    roomy = args.requests * per_req + 64
    gib = 1 << 30

    held = {
        "one pool": run(args, roomy, 0),
        "two pools, freeing off": run(args, roomy, roomy, freeing=False),
        "two pools, freeing on": run(args, roomy, roomy),
    }
    print(
        f"1. held at peak, {args.requests} requests x {args.prompt} tokens "
        f"(window {args.window}, page size {ps}, {LAYERS}-layer pattern, "
        f"{SLIDING_LAYERS} sliding):"
    )
    base = held["one pool"]["bytes"]
    for name, r in held.items():
        print(
            f"   {name:24s} full {r['full_pages']:6d}  sliding {r['sliding_pages']:6d} pages  "
            f"{r['bytes'] / gib:6.2f} GiB  ({base / r['bytes']:.2f}x less than one pool)  "
            f"[{r['seconds']} s]"
        )

    # The budget: what one pool for every layer needs for budget_requests.
    budget_units = args.budget_requests * per_req * ps * LAYERS
    admitted = {"one pool": run(args, budget_units // (ps * LAYERS), 0)}
    for ratio in args.ratios:
        full_pages = int(budget_units / (ps * ((LAYERS - SLIDING_LAYERS) + SLIDING_LAYERS * ratio)))
        swa_pages = int(full_pages * ratio)
        r = run(args, full_pages, swa_pages)
        r["pools"] = [full_pages, swa_pages]
        admitted[f"two pools, ratio {ratio:g}"] = r
    budget_gib = budget_units * args.layer_token_bytes / gib
    print(
        f"2. admitted at a fixed KV budget of {budget_gib:.2f} GiB "
        f"(one pool for every layer holds {args.budget_requests} requests):"
    )
    base_run = admitted["one pool"]["max_running"]
    for name, r in admitted.items():
        pools = f"pools {r['pools']}" if "pools" in r else ""
        print(
            f"   {name:24s} running at once: max {r['max_running']:3d} "
            f"({r['max_running'] / base_run:.2f}x)  "
            f"retractions {r['retractions']}  steps to serve all {r['steps']}  {pools}  "
            f"[{r['seconds']} s]"
        )
    print(json.dumps({"args": vars(args), "held": held, "admitted": admitted}))


if __name__ == "__main__":
    main()
