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
import struct
import sys
import time
import tracemalloc
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
from scheduler_service.gc_tuning import tune_gc
from scheduler_service.testing.simulated_worker import SimulatedWorker

try:  # packed keys and page tables (radix_node.id_array)
    from scheduler_service.core.radix_node import id_array

    PACKED = True
except ImportError:  # an older checkout (A/B base) whose cache takes lists of ints
    PACKED = False

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
        tokens = req.prompt_ids + req.output_ids
        if PACKED:
            tokens = id_array(tokens)
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


# ------------------------------------------------------------ footprint
def _fresh_ints(ids: list[int]) -> list[int]:
    """The key as a request holds it: packed (this checkout), or for a list
    cache the same ids as int objects of their own (a tokenizer's output
    shares none with other requests; the trace's prompts share their system
    part)."""
    if PACKED:
        return id_array(ids)
    return list(struct.unpack(f"{len(ids)}i", struct.pack(f"{len(ids)}i", *ids)))


def _build(seqs: list[list[int]], cache: RadixCache, timed: bool) -> list[float]:
    """Insert every sequence (with fresh pages for its uncached part); return
    the seconds of each match and insert when ``timed``."""
    pool, page_size = cache.pool, cache.page_size
    ops: list[float] = []
    clock = time.perf_counter
    for seq in seqs:
        key = _fresh_ints(seq[: len(seq) - len(seq) % page_size])
        t0 = clock()
        m = cache.match(key)
        t1 = clock()
        fresh = pool.alloc(len(key) // page_size - len(m.pages))
        t2 = clock()
        result = cache.insert(key, m.pages + fresh)
        t3 = clock()
        assert not result.dup_pages
        if timed:
            ops.append(t1 - t0)
            ops.append(t3 - t2)
    return ops


def _empty_cache(seqs: list[list[int]], page_size: int) -> tuple[PagePool, RadixCache]:
    pool = PagePool(sum(len(s) for s in seqs) // page_size + 1, page_size)
    return pool, RadixCache(page_size, pool)


def cache_footprint(trace: list[TraceRequest], page_size: int) -> dict[str, float]:
    seqs = [r.prompt_ids + r.output_ids for r in trace]
    # Memory: a separate, untimed build under tracemalloc (the pool and the
    # sequences exist before it starts).
    pool, cache = _empty_cache(seqs, page_size)
    gc.collect()
    tracemalloc.start()
    _build(seqs, cache, timed=False)
    # The cache alone: not the pool's free list, which shrinks as its pages
    # move into the cache (a realloc of a block made before tracing started
    # counts as a new block, and its old one is not subtracted).
    pool_file = tracemalloc.Filter(False, "*" + PagePool.__module__.replace(".", "/") + ".py")
    snapshot = tracemalloc.take_snapshot().filter_traces([pool_file])
    retained = sum(stat.size for stat in snapshot.statistics("filename"))
    tracemalloc.stop()
    del snapshot
    cached_tokens = cache.cached_pages * page_size
    del pool, cache
    gc.collect()

    # Latency under the service's GC settings (freeze what exists, young
    # threshold 20,000): every operation timed while building, then a replay
    # of the trace against the full cache with eviction (LRU churn).
    saved = gc.get_threshold()
    pool, cache = _empty_cache(seqs, page_size)
    tune_gc()
    # Every automatic collection's pause (by the CPU time of this thread, so
    # another process taking the core does not count), to tell a slow op
    # caused by the collector from one the machine's load stretched.
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses.append(time.thread_time() - started[0])

    gc.callbacks.append(on_gc)
    try:
        tracked_before = len(gc.get_objects())
        build_ops = _build(seqs, cache, timed=True)
        tracked = len(gc.get_objects()) - tracked_before
        clock = time.perf_counter
        churn_ops: list[float] = []
        for req in trace[: len(trace) // 2]:
            key = _fresh_ints(req.prompt_ids[::-1][: 1024 - 1024 % page_size])  # new prefixes
            t0 = clock()
            m = cache.match(key)
            t1 = clock()
            need = len(key) // page_size - len(m.pages)
            cache.evict(need - pool.num_free)
            t2 = clock()
            fresh = pool.alloc(need)
            t3 = clock()
            cache.insert(key, m.pages + fresh)
            t4 = clock()
            churn_ops += [t1 - t0, t2 - t1, t4 - t3]
        # Fresh pages for cached sequences: everything comes back as duplicates.
        seqs = [
            _fresh_ints(r.prompt_ids[: 2048 - 2048 % page_size])
            for r in trace[: len(trace) // 4]
            if cache.match(r.prompt_ids, touch=False).length >= 2048 - 2048 % page_size
        ][:2000]
        own = pool.alloc(len(seqs[0]) // page_size) if seqs else []
        t0 = clock()
        for key in seqs:
            result = cache.insert(key, own)
        dup_seconds = clock() - t0
        assert not seqs or result.dup_pages == own
        pool.release(own)
        dup_inserts = len(seqs)
        del seqs, result
        gc.callbacks.remove(on_gc)
        t0 = clock()
        gc.collect()
        full_gc = clock() - t0
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.set_threshold(*saved)
    ms = lambda xs: sorted(x * 1e3 for x in xs)  # noqa: E731
    b, c = ms(build_ops), ms(churn_ops)
    return {
        "cached_tokens": cached_tokens,
        "mib": retained / 2**20,
        "bytes_per_token": retained / cached_tokens,
        "gc_tracked_objects": tracked,
        "full_gc_ms": full_gc * 1e3,
        "auto_gc_pauses": len(pauses),
        "auto_gc_pause_ms_max": max(pauses, default=0.0) * 1e3,
        "build_op_ms_max": b[-1],
        "build_op_ms_p999": b[int(len(b) * 0.999)],
        "churn_op_ms_max": c[-1],
        "churn_op_ms_p999": c[int(len(c) * 0.999)],
        "ops_over_5ms": sum(x > 5 for x in b) + sum(x > 5 for x in c),
        "dup_insert_us": dup_seconds / max(dup_inserts, 1) * 1e6,
        "dup_inserts": dup_inserts,
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
