"""The radix cache's footprint and pauses, for benchmarks/scheduler_core.py
(its docstring, measurement 2, says what is measured): memory retained per
cached token, GC-tracked objects, a full collection's time, the slowest
single operation with the service's GC settings while building and under
LRU churn, and fresh-page inserts. Runs on a checkout whose cache takes
lists too (an A/B base), with keys as lists of int objects of their own.
"""

from __future__ import annotations

import gc
import struct
import time
import tracemalloc

from clients.workloads import TraceRequest
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.gc_tuning import tune_gc

try:  # packed keys and page tables (radix_node.id_array)
    from scheduler_service.core.ids import id_array

    PACKED = True
except ImportError:  # an older checkout (A/B base) whose cache takes lists of ints
    PACKED = False


def pack_tokens(ids: list[int]) -> list[int]:
    """A request's token ids as the scheduler holds them: packed once on this
    checkout, the list itself on a list cache."""
    return id_array(ids) if PACKED else ids


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
