"""Benchmark of the pure-Python scheduler core (a program, not a test).

Two measurements, each repeated ``--runs`` times (medians reported):

1. Radix replay: SGLang's generated-shared-prefix trace (seed 42, 100 groups
   x 100 prompts, 2048/128/256, vocab 128256) replayed on a RadixCache of
   1,000,000 tokens at page size 1 with 64 requests in flight, the oldest
   finishing first. On admit: match the prompt, evict what is short, insert
   the prompt, lock it; on finish: evict what is short, insert
   prompt + output, unlock. Reports requests/s, the hit rate (must be
   0.9318) and the share of replay time spent evicting.
2. Scheduler steps: ``Scheduler.step()`` + ``update()`` wall time (the
   simulated worker's time excluded) with 256 running decode requests and
   1,000 waiting (lpm), split into decode steps and steps that admit.

The last line printed is one JSON object with the figures.

    python benchmarks/scheduler_core.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients.workloads import TraceRequest, generated_shared_prefix
from scheduler_service.core import (
    ForwardMode,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler_service.core.page_pool import PagePool
from scheduler_service.core.radix_cache import RadixCache
from scheduler_service.testing.simulated_worker import SimulatedWorker

VOCAB = 128256
TARGET_REPLAY_REQ_PER_S = 4000
TARGET_HIT_RATE = 0.9318
TARGET_DECODE_MS = 1.0
TARGET_ADMIT_MS = 5.0


# --------------------------------------------------------------- replay
def radix_replay(
    trace: list[TraceRequest], capacity: int = 1_000_000, in_flight: int = 64
) -> dict[str, float]:
    pool = PagePool(capacity, 1)
    cache = RadixCache(1, pool)
    flight: deque = deque()
    hit = total = 0
    evict_s = 0.0

    def make_room(n: int) -> list[int]:
        nonlocal evict_s
        short = n - pool.num_free
        if short > 0:
            t = time.perf_counter()
            cache.evict(short)
            evict_s += time.perf_counter() - t
        pages = pool.alloc(n)
        assert pages is not None, "replay ran out of pages"
        return pages

    def finish() -> None:
        req, node, prompt_pages = flight.popleft()
        out_pages = make_room(len(req.output_ids))
        result = cache.insert(req.prompt_ids + req.output_ids, prompt_pages + out_pages)
        pool.release(result.dup_pages)
        cache.unlock(node)

    gc.collect()
    start = time.perf_counter()
    for req in trace:
        if len(flight) >= in_flight:
            finish()
        m = cache.match(req.prompt_ids)
        hit += m.length
        total += len(req.prompt_ids)
        pages = m.pages + make_room(len(req.prompt_ids) - m.length)
        result = cache.insert(req.prompt_ids, pages)
        pool.release(result.dup_pages)
        cache.lock(result.node)
        flight.append((req, result.node, pages))
    while flight:
        finish()
    elapsed = time.perf_counter() - start
    holders: dict[int, int] = {}
    cache.check_integrity(holders)
    pool.check_integrity(holders)
    return {
        "req_per_s": len(trace) / elapsed,
        "hit_rate": hit / total,
        "evict_share": evict_s / elapsed,
        "seconds": elapsed,
    }


# ---------------------------------------------------------------- steps
class StepWorkload:
    """Shared-prefix requests arriving so that 1,000 are always waiting."""

    def __init__(self, seed: int, groups: int = 16, system_len: int = 1024, question_len: int = 64):
        self.rng = random.Random(seed)
        rr = self.rng.randrange
        self.systems = [[rr(VOCAB) for _ in range(system_len)] for _ in range(groups)]
        self.question_len = question_len
        self.count = 0

    def next(self) -> Request:
        rr = self.rng.randrange
        prompt = self.rng.choice(self.systems) + [rr(VOCAB) for _ in range(self.question_len)]
        self.count += 1
        sp = SamplingParams(max_new_tokens=rr(128, 513), ignore_eos=True)
        return Request(f"q{self.count}", prompt, sp)


def step_benchmark(
    seed: int, page_size: int, measured_steps: int, running: int = 256, waiting: int = 1000
) -> dict[str, float]:
    config = SchedulerConfig(
        page_size=page_size,
        max_running_requests=running,
        schedule_policy="lpm",
        vocab_size=VOCAB,
    )
    num_pages = 700_000 // page_size
    sched = Scheduler(config, num_pages)
    worker = SimulatedWorker(num_pages, page_size, VOCAB, check_reads=False)
    work = StepWorkload(seed)
    for _ in range(running + waiting):
        sched.add_request(work.next())

    def one_step() -> tuple[float, ForwardMode | None, int]:
        t0 = time.perf_counter()
        plan = sched.step()
        t1 = time.perf_counter()
        if plan is None:
            return t1 - t0, None, 0
        result = worker.execute(plan)
        t2 = time.perf_counter()
        sched.update(result)
        sched.drain()
        t3 = time.perf_counter()
        while len(sched.waiting) < waiting:
            sched.add_request(work.next())
        return (t1 - t0) + (t3 - t2), plan.mode, len(plan.joins)

    # Warm up until the batch is full and the cache holds the system prompts.
    for _ in range(10_000):
        one_step()
        if len(sched.running) >= running:
            break
    for _ in range(50):
        one_step()
    decode_ms: list[float] = []
    admit_ms: list[float] = []
    running_seen: list[int] = []
    gc.collect()
    for _ in range(measured_steps):
        running_seen.append(len(sched.running))
        seconds, mode, joins = one_step()
        if mode is ForwardMode.DECODE:
            decode_ms.append(seconds * 1e3)
        elif joins:
            admit_ms.append(seconds * 1e3)
    sched.check_integrity()
    return {
        "decode_step_ms_p50": statistics.median(decode_ms),
        "decode_step_ms_p90": statistics.quantiles(decode_ms, n=10)[-1],
        "admit_step_ms_p50": statistics.median(admit_ms),
        "admit_step_ms_p90": statistics.quantiles(admit_ms, n=10)[-1],
        "decode_steps": len(decode_ms),
        "admit_steps": len(admit_ms),
        "running_median": statistics.median(running_seen),
        "waiting": len(sched.waiting),
        "cached_token_share": sched.stats.cached_tokens / max(sched.stats.prompt_tokens, 1),
    }


# ----------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="measured scheduler steps per run")
    parser.add_argument("--quick", action="store_true", help="a tenth of the replay trace")
    args = parser.parse_args()

    groups = 10 if args.quick else 100
    t = time.perf_counter()
    trace = generated_shared_prefix(
        seed=42,
        num_groups=groups,
        prompts_per_group=100,
        system_prompt_len=2048,
        question_len=128,
        output_len=256,
        vocab=VOCAB,
    )
    print(f"trace: {len(trace)} requests generated in {time.perf_counter() - t:.1f}s")

    replays = []
    for run in range(args.runs):
        r = radix_replay(trace)
        replays.append(r)
        print(
            f"replay run {run + 1}: {r['req_per_s']:8.0f} req/s  hit rate {r['hit_rate']:.4f}  "
            f"evicting {r['evict_share']:.0%} of {r['seconds']:.2f}s"
        )
    steps = {}
    for page_size in (1, 16):
        runs = []
        for run in range(args.runs):
            s = step_benchmark(seed=run, page_size=page_size, measured_steps=args.steps)
            runs.append(s)
            print(
                f"steps page_size={page_size:2d} run {run + 1}: decode p50 "
                f"{s['decode_step_ms_p50']:.3f} ms (p90 {s['decode_step_ms_p90']:.3f}, "
                f"n={s['decode_steps']}), admit p50 {s['admit_step_ms_p50']:.3f} ms "
                f"(p90 {s['admit_step_ms_p90']:.3f}, n={s['admit_steps']}), "
                f"running {s['running_median']:.0f}, waiting {s['waiting']}"
            )
        steps[page_size] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    med = lambda key: statistics.median(r[key] for r in replays)  # noqa: E731
    hit_rate = round(med("hit_rate"), 4)
    figures = {
        "radix_replay_req_per_s": round(med("req_per_s"), 1),
        "radix_replay_hit_rate": hit_rate,
        "radix_replay_evict_share": round(med("evict_share"), 3),
        "decode_step_ms_p50": round(steps[1]["decode_step_ms_p50"], 4),
        "admit_step_ms_p50": round(steps[1]["admit_step_ms_p50"], 4),
        "decode_step_ms_p50_page16": round(steps[16]["decode_step_ms_p50"], 4),
        "admit_step_ms_p50_page16": round(steps[16]["admit_step_ms_p50"], 4),
        "runs": args.runs,
        "quick": args.quick,
    }
    if not args.quick:
        figures["targets_met"] = {
            "radix_replay_req_per_s": figures["radix_replay_req_per_s"] >= TARGET_REPLAY_REQ_PER_S,
            "radix_replay_hit_rate": hit_rate == TARGET_HIT_RATE,
            "decode_step_ms_p50": figures["decode_step_ms_p50"] < TARGET_DECODE_MS,
            "admit_step_ms_p50": figures["admit_step_ms_p50"] < TARGET_ADMIT_MS,
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
