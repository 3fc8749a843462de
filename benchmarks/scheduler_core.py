"""Benchmark of the pure-Python scheduler core (a program, not a test).

Three measurements, each repeated ``--runs`` times (medians reported):

1. Radix replay: SGLang's generated-shared-prefix trace (seed 42, 100 groups
   x 100 prompts, 2048/128/256, vocab 128256) replayed on a RadixCache of
   1,000,000 tokens at page size 1 with 64 requests in flight, the oldest
   finishing first. On admit: match the prompt, evict what is short, insert
   the prompt, lock it; on finish: evict what is short, insert
   prompt + output, unlock. Each request's token ids are packed once when it
   arrives (as the scheduler does at submission: ``Request.token_array``),
   inside the timed loop. Reports requests/s, the hit rate (must be 0.9318)
   and the share of replay time spent evicting and packing.
2. Cache footprint (on unless ``--no-footprint``; ``--only-footprint``
   for it alone): every request of the trace (prompt + output, 4 M tokens)
   inserted into a cache large enough to hold it all, at page size 1 and
   16, each key packed as a request packs its tokens (on a checkout whose
   cache takes lists: int objects of its own, as a tokenizer's output).
   Reports the memory the cache retains per cached token (tracemalloc, in a
   separate build, the page pool's own allocations left out), the
   GC-tracked objects it adds, the time of a full ``gc.collect()`` over it,
   and, with the service's GC settings (``gc_tuning.tune_gc``), the slowest
   single match/insert/evict while building it and then while replaying the
   trace against it at capacity (LRU churn). Also the rate of inserting
   fresh pages for cached sequences (every page comes back as a duplicate).
3. Scheduler steps (unless ``--no-steps``): ``Scheduler.step()`` +
   ``update()`` wall time (``--cpu-clock``: this thread's CPU time, steadier
   on a shared machine; the simulated worker's time excluded) with 256
   running decode requests and 1,000 waiting (lpm), split into decode steps
   and steps that admit.

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

from benchmarks.radix_footprint import cache_footprint, pack_tokens
from clients.workloads import TraceRequest, generated_shared_prefix
from scheduler_service.core import (
    ForwardMode,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
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
        tokens, node, prompt_pages = flight.popleft()
        out_pages = make_room(len(tokens) - len(prompt_pages))
        result = cache.insert(tokens, prompt_pages + out_pages)
        pool.release(result.dup_pages)
        cache.unlock(node)

    clock = time.perf_counter
    pack_s = 0.0
    gc.collect()
    start = clock()
    for req in trace:
        if len(flight) >= in_flight:
            finish()
        # The request's tokens, packed once on arrival (prompt + output: the
        # output is appended as it is generated, one packing in all).
        t = clock()
        tokens = pack_tokens(req.prompt_ids + req.output_ids)
        pack_s += clock() - t
        n_prompt = len(req.prompt_ids)
        m = cache.match(tokens, limit=n_prompt)
        hit += m.length
        total += n_prompt
        pages = m.pages + make_room(n_prompt - m.length)
        result = cache.insert(tokens[:n_prompt], pages)
        pool.release(result.dup_pages)
        cache.lock(result.node)
        flight.append((tokens, result.node, pages))
    while flight:
        finish()
    elapsed = clock() - start
    holders: dict[int, int] = {}
    cache.check_integrity(holders)
    pool.check_integrity(holders)
    return {
        "req_per_s": len(trace) / elapsed,
        "hit_rate": hit / total,
        "evict_share": evict_s / elapsed,
        "pack_share": pack_s / elapsed,
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
    seed: int,
    page_size: int,
    measured_steps: int,
    running: int = 256,
    waiting: int = 1000,
    clock=time.perf_counter,
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
        t0 = clock()
        plan = sched.step()
        t1 = clock()
        if plan is None:
            return t1 - t0, None, 0
        result = worker.execute(plan)
        t2 = clock()
        sched.update(result)
        sched.drain()
        t3 = clock()
        while len(sched.table.waiting) < waiting:
            sched.add_request(work.next())
        return (t1 - t0) + (t3 - t2), plan.mode, len(plan.joins)

    # Warm up until the batch is full and the cache holds the system prompts.
    for _ in range(10_000):
        one_step()
        if len(sched.table.running) >= running:
            break
    for _ in range(50):
        one_step()
    decode_ms: list[float] = []
    admit_ms: list[float] = []
    running_seen: list[int] = []
    gc.collect()
    for _ in range(measured_steps):
        running_seen.append(len(sched.table.running))
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
        "waiting": len(sched.table.waiting),
        "cached_token_share": sched.stats.cached_tokens / max(sched.stats.prompt_tokens, 1),
    }


# ----------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="measured scheduler steps per run")
    parser.add_argument("--quick", action="store_true", help="a tenth of the replay trace")
    parser.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time scheduler steps by this thread's CPU time (steadier on a shared machine)",
    )
    parser.add_argument("--no-footprint", action="store_true", help="skip the cache footprint")
    parser.add_argument("--no-steps", action="store_true", help="skip the scheduler steps")
    parser.add_argument("--only-footprint", action="store_true", help="footprint alone")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_clock else time.perf_counter

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

    footprint: dict[int, dict[str, float]] = {}
    if not args.no_footprint:
        for page_size in (1, 16):
            runs = []
            for run in range(args.runs):
                f = cache_footprint(trace, page_size)
                runs.append(f)
                print(
                    f"footprint page_size={page_size:2d} run {run + 1}: "
                    f"{f['mib']:.0f} MiB for {f['cached_tokens']} tokens "
                    f"({f['bytes_per_token']:.1f} B/token), {f['gc_tracked_objects']} GC objects, "
                    f"full gc {f['full_gc_ms']:.1f} ms, slowest automatic gc pause "
                    f"{f['auto_gc_pause_ms_max']:.2f} ms (cpu), slowest op build "
                    f"{f['build_op_ms_max']:.2f} ms churn {f['churn_op_ms_max']:.2f} ms "
                    f"({f['ops_over_5ms']} over 5 ms), fresh-page insert "
                    f"{f['dup_insert_us']:.1f} us (n={f['dup_inserts']})"
                )
            footprint[page_size] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if args.only_footprint:
        print(json.dumps({"footprint": footprint, "runs": args.runs, "quick": args.quick}))
        return

    replays = []
    for run in range(args.runs):
        r = radix_replay(trace)
        replays.append(r)
        print(
            f"replay run {run + 1}: {r['req_per_s']:8.0f} req/s  hit rate {r['hit_rate']:.4f}  "
            f"evicting {r['evict_share']:.0%}, packing {r['pack_share']:.0%} of {r['seconds']:.2f}s"
        )
    steps = {}
    for page_size in () if args.no_steps else (1, 16):
        runs = []
        for run in range(args.runs):
            s = step_benchmark(run, page_size, args.steps, clock=clock)
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
        "radix_replay_pack_share": round(med("pack_share"), 3),
        "runs": args.runs,
        "quick": args.quick,
    }
    if steps:
        figures.update(
            decode_step_ms_p50=round(steps[1]["decode_step_ms_p50"], 4),
            admit_step_ms_p50=round(steps[1]["admit_step_ms_p50"], 4),
            decode_step_ms_p50_page16=round(steps[16]["decode_step_ms_p50"], 4),
            admit_step_ms_p50_page16=round(steps[16]["admit_step_ms_p50"], 4),
        )
    for page_size, f in footprint.items():
        figures[f"footprint_page{page_size}"] = {k: round(v, 3) for k, v in f.items()}
    if not args.quick and steps:
        figures["targets_met"] = {
            "radix_replay_req_per_s": figures["radix_replay_req_per_s"] >= TARGET_REPLAY_REQ_PER_S,
            "radix_replay_hit_rate": hit_rate == TARGET_HIT_RATE,
            "decode_step_ms_p50": figures["decode_step_ms_p50"] < TARGET_DECODE_MS,
            "admit_step_ms_p50": figures["admit_step_ms_p50"] < TARGET_ADMIT_MS,
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
