"""Benchmark of speculative drafting in the scheduler core (a program, not a test).

What drafting costs the scheduler per running request and step, with 16 and
64 running requests of 1-2k tokens (prompt 1000-1900 + outputs), medians over
``--runs``:

1. Drafter (``NgramDrafter.propose``, k = 8) per request per step, one new
   token per step, on three kinds of text:
   - ``random``: uniform tokens from 32,000 (no source ever matches: the
     trigram/bigram lookups miss, the cache walk backs off);
   - ``repetitive``: tokens from 64 ids, so bigrams repeat and most lookups
     return drafts (the prompt-lookup path with results);
   - ``radix``: every request's sequence was answered before and is in the
     radix cache: the first call walks the tree, later ones advance the
     cursor.
   ``first_call_us``: the first call of a request (the prompt's n-gram index
   is built then, once, if its last bigram repeats; random text only scans).
2. The wake checks of dormant requests (``DraftWatch.wants``: what random
   text pays), per request per step.
3. Whole core: ``Scheduler.step()`` + ``update()`` per step with the
   requests decoding random text, speculative decoding on vs off (the
   simulated worker's time excluded; this thread's CPU time, steadier on a
   shared machine), after WARMUP_STEPS untimed steps.

The last line printed is one JSON object with the figures.

    python benchmarks/spec_drafting.py [--runs 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.spec.drafts import NgramDrafter
from scheduler_service.core.spec.rows import DraftWatch
from scheduler_service.core.spec.state import SpecState
from scheduler_service.testing.simulated_worker import SimulatedWorker

VOCAB = 32000
WARMUP_STEPS = 40


def _text(rng: random.Random, kind: str, n: int) -> list[int]:
    vocab = 64 if kind == "repetitive" else VOCAB
    return [rng.randrange(vocab) for _ in range(n)]


def bench_drafter(n_reqs: int, kind: str, steps: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    pool = PagePool(4_000_000, 1)
    cache = RadixCache(1, pool)
    drafter = NgramDrafter(cache)
    reqs: list[tuple[Request, SpecState, list[int]]] = []
    for i in range(n_reqs):
        prompt = _text(rng, kind, rng.randint(1000, 1900))
        future = _text(rng, kind, steps + 16)
        if kind == "radix":  # answered before: prompt + answer are cached
            seq = prompt + future
            cache.insert(seq, pool.alloc(len(seq)))
        req = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=steps + 16))
        req.output_ids.append(future[0])
        reqs.append((req, SpecState(8), future))
    t0 = time.perf_counter()
    for req, state, _ in reqs:
        drafter.propose(req, state, 8)
    build_us = (time.perf_counter() - t0) / n_reqs * 1e6
    spent = 0.0
    proposed = 0
    for step in range(1, steps):
        for req, state, future in reqs:
            req.output_ids.append(future[step])
            t0 = time.perf_counter()
            drafts = drafter.propose(req, state, 8)
            spent += time.perf_counter() - t0
            proposed += bool(drafts)
    calls = n_reqs * (steps - 1)
    return {
        "us_per_req_step": spent / calls * 1e6,
        "first_call_us": build_us,
        "share_with_drafts": proposed / calls,
    }


def bench_wake_check(n_reqs: int, steps: int, seed: int) -> float:
    """Dormant requests on random text: the per-step check in step()."""
    rng = random.Random(seed)
    pool = PagePool(1000, 1)
    cache = RadixCache(1, pool)
    drafter = NgramDrafter(cache)
    batch: dict[str, Request] = {}  # the running batch, by rid
    watch = DraftWatch(drafter, None)
    futures = []
    for i in range(n_reqs):
        req = Request(f"r{i}", _text(rng, "random", rng.randint(1000, 1900)))
        req.output_ids.append(1)
        req.spec = SpecState(8)
        batch[req.rid] = req
        watch.add(req)
        futures.append((req, _text(rng, "random", steps)))
    watch.wants(batch, 0)  # the first look of each
    spent = 0.0
    for step in range(1, steps):
        for req, future in futures:
            req.output_ids.append(future[step])
        t0 = time.perf_counter()
        watch.wants(batch, step)
        spent += time.perf_counter() - t0
    return spent / (n_reqs * (steps - 1)) * 1e6


def bench_core(n_reqs: int, steps: int, spec: bool, seed: int) -> float:
    """step() + update() per step, random text, the worker's time excluded."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        vocab_size=VOCAB, page_size=16, speculative_ngram=spec, max_running_requests=n_reqs
    )
    pages = n_reqs * (2000 + steps) // 16 + 64
    sched = Scheduler(config, pages)
    worker = SimulatedWorker(pages, 16, VOCAB, check_reads=False)
    for i in range(n_reqs):
        prompt = _text(rng, "random", rng.randint(1000, 1900))
        sched.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_new_tokens=steps + WARMUP_STEPS + 50))
        )
    while sched.table.waiting or sched.table.chunked is not None:  # prefill everything first
        sched.update(worker.execute(sched.step()))
    spent = 0.0
    inflight = []
    clock = time.thread_time
    for step in range(-WARMUP_STEPS, steps):
        if step == 0:
            spent = 0.0
        t0 = clock()
        plan = sched.step()
        spent += clock() - t0
        if plan is not None:
            inflight.append(plan)
        while inflight and (len(inflight) > 1 or plan is None):
            result = worker.execute(inflight.pop(0))
            t0 = clock()
            sched.update(result)
            spent += clock() - t0
    assert sched.stats.spec_drains == 0 and sched.stats.spec_steps == 0
    return spent / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    out: dict[str, float] = {}
    for n in (16, 64):
        for kind in ("random", "repetitive", "radix"):
            runs = [bench_drafter(n, kind, args.steps, seed) for seed in range(args.runs)]
            for key in runs[0]:
                v = statistics.median(r[key] for r in runs)
                out[f"drafter_{kind}_{n}_{key}"] = round(v, 3)
            print(
                f"drafter {kind:10s} {n:3d} requests: "
                f"{out[f'drafter_{kind}_{n}_us_per_req_step']:.2f} us/request/step, "
                f"first call {out[f'drafter_{kind}_{n}_first_call_us']:.0f} us, "
                f"drafts on {out[f'drafter_{kind}_{n}_share_with_drafts']:.0%} of calls"
            )
        v = statistics.median(bench_wake_check(n, args.steps, s) for s in range(args.runs))
        out[f"wake_check_{n}_us_per_req_step"] = round(v, 3)
        print(f"dormant wake check  {n:3d} requests: {v:.2f} us/request/step")
        core: dict[bool, list[float]] = {False: [], True: []}
        for seed in range(args.runs):  # interleaved: a shared machine's drift hits both
            for spec in (False, True):
                core[spec].append(bench_core(n, args.steps, spec, seed))
        for spec in (False, True):
            v = statistics.median(core[spec])
            out[f"core_step_{n}_spec_{'on' if spec else 'off'}_us"] = round(v, 1)
            print(
                f"core step+update    {n:3d} requests, spec {'on ' if spec else 'off'}: {v:.0f} us"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
