"""Random scheduler workloads for the property tests: a hypothesis strategy
that draws a configuration (page size 1 or 16, tiny pools, chunking, policies,
priorities, mixed steps) and a workload (shared prefixes, arrival times,
lengths, aborts, extra keys, prompt logprobs) over a vocabulary of VOCAB
tokens that ends sequences with EOS."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from scheduler_service.core import LogprobOptions, Request, SamplingParams, SchedulerConfig
from scheduler_service.core.config import (
    HICACHE_PREFETCH_POLICIES,
    HICACHE_WRITE_POLICIES,
    POLICIES,
)
from scheduler_service.testing.simulated_files import SimulatedFiles

VOCAB = 40
EOS = 0


class Ticks:
    """A clock that moves a millisecond each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@st.composite
def scenarios(
    draw,
    pressure: bool = False,
    sliding: bool = False,
    host_tier: bool = False,
    storage: bool = False,
):
    """A config and workload; with ``pressure`` many long requests arrive at
    once into a pool that fits only a few, and admission over-commits. With
    ``sliding`` the model has sliding-window layers: a sixth item gives the
    sliding pool and window (``make_pair``'s keywords), the pool sometimes
    as small as one request's chunk plus its window. With ``host_tier`` the
    device pool is small and a host pool (kv/hiradix_cache.py), usually
    several times larger, sometimes smaller, holds what it evicts, under a
    drawn write policy. With ``storage`` (and the host tier) a file tier
    sits behind it: a sixth item gives the simulated files (reads failing
    at random, reported up to a few plans late, a cap that makes the
    scheduler's index wrong) and a clock that ticks on every look, so
    prefetches time out under the timeout policy."""
    page_size = draw(st.sampled_from([1, 16]))
    chunk_opts = [None, 16, 32, 64] if page_size == 16 else [None, 3, 8, 32]
    n_prefixes = draw(st.integers(1, 4))
    # The host tier is exercised by prefixes the device evicts before they
    # are used again: longer ones, and arrivals spread wider.
    prefixes = [
        draw(
            st.lists(
                st.integers(1, VOCAB - 1),
                min_size=2 * page_size if host_tier else 0,
                max_size=(5 if host_tier else 3) * page_size + 5,
            )
        )
        for _ in range(n_prefixes)
    ]
    n_reqs = draw(st.integers(8, 20) if pressure else st.integers(1, 20))
    arrivals: list[tuple[int, Request]] = []
    aborts: dict[int, list[str]] = {}
    aborted: set[str] = set()
    for i in range(n_reqs):
        prefix = prefixes[draw(st.integers(0, n_prefixes - 1))]
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
        max_new = draw(st.integers(16, 48) if pressure else st.integers(0, 48))
        min_new = draw(st.integers(0, max_new)) if draw(st.booleans()) else 0
        rid = f"r{i}"
        # A request that wants its prompt's logprobs reads nothing of them
        # from the cache, so it computes cached pages again (duplicates).
        logprobs = LogprobOptions()
        if draw(st.integers(0, 3)) == 0:
            start = draw(st.integers(0, len(prefix) + len(suffix) - 1))
            logprobs = LogprobOptions(return_logprob=True, logprob_start_len=start)
        req = Request(
            rid,
            prefix + suffix,
            SamplingParams(
                max_new_tokens=max_new,
                min_new_tokens=min_new,
                ignore_eos=draw(st.sampled_from([False, False, False, True])),
                stop_token_ids=frozenset(draw(st.lists(st.integers(1, VOCAB - 1), max_size=2))),
                stop_strs=tuple(
                    "".join(
                        f"<{t}>" for t in draw(st.lists(st.integers(0, 7), min_size=1, max_size=2))
                    )
                    for _ in range(draw(st.integers(0, 2)))
                ),
            ),
            priority=draw(st.sampled_from([0, 0, 5, 20, 40])),
            extra_key=draw(st.sampled_from([None, None, None, "a", "b"])),
            routing_key=draw(st.sampled_from([None, "x", "y"])),
            logprobs=logprobs,
        )
        arrival = draw(st.integers(0, 4 if pressure else 120 if host_tier else 40))
        arrivals.append((arrival, req))
        if draw(st.integers(0, 9)) == 0:
            at = arrival + draw(st.integers(0, 30))
            aborts.setdefault(at, []).append(rid)
            aborted.add(rid)
    # Every request fits the pool on its own; beyond that the pool is small
    # enough that eviction and retraction happen.
    need = max(
        -(-(len(r.prompt_ids) + r.sampling.max_new_tokens + 1) // page_size) for _, r in arrivals
    )
    num_pages = need + draw(st.integers(0, need // 2 if pressure or host_tier else 2 * need))
    chunk = draw(st.sampled_from(chunk_opts))
    config = SchedulerConfig(
        page_size=page_size,
        max_running_requests=draw(st.integers(4, 8) if pressure else st.integers(1, 8)),
        max_prefill_tokens=draw(st.sampled_from([16, 48, 256])),
        chunked_prefill_size=chunk,
        schedule_policy=draw(st.sampled_from(POLICIES)),
        enable_mixed_chunk=draw(st.booleans()),
        enable_priority_scheduling=draw(st.booleans()),
        schedule_low_priority_values_first=draw(st.booleans()),
        eos_token_ids=frozenset({EOS}),
        vocab_size=VOCAB,
        random_seed=draw(st.integers(0, 3)),
        # A low ratio over-admits, so decode runs out of pages and retracts.
        init_new_token_ratio=0.01 if pressure else draw(st.sampled_from([0.7, 0.1, 0.01])),
        new_token_ratio_decay_steps=draw(st.sampled_from([600, 10])),
        enable_kv_events=draw(st.booleans()),
    )
    if host_tier:
        config = dataclasses.replace(
            config,
            hicache_host_pages=max(1, int(num_pages * draw(st.sampled_from([0.5, 1, 3, 6])))),
            hicache_write_policy=draw(st.sampled_from(HICACHE_WRITE_POLICIES)),
            hicache_write_through_threshold=draw(st.integers(1, 3)),
            hicache_load_back_threshold=draw(st.sampled_from([0, 1, 1, 10])),
        )
    if storage:
        # A host pool small enough to evict what the files keep.
        host = max(1, int(num_pages * draw(st.sampled_from([0.25, 0.5, 1]))))
        config = dataclasses.replace(
            config,
            hicache_host_pages=host,
            hicache_storage_pages=draw(st.sampled_from([16, 4096])),
            hicache_storage_prefetch_threshold=page_size * draw(st.integers(1, 3)),
            hicache_storage_prefetch_policy=draw(st.sampled_from(HICACHE_PREFETCH_POLICIES)),
            hicache_storage_timeout_base_s=draw(st.sampled_from([0.0, 0.01, 1.0])),
        )
        files = SimulatedFiles(
            fail_rate=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
            max_delay=draw(st.integers(0, 4)),
            capacity=draw(st.sampled_from([16, 1 << 20])),
            seed=draw(st.integers(0, 99)),
        )
        return config, num_pages, arrivals, aborts, aborted, {"files": files, "clock": Ticks()}
    if not sliding:
        return config, num_pages, arrivals, aborts, aborted
    window = draw(st.sampled_from([2, 5, 17, 40] if page_size == 1 else [16, 20, 33, 64]))
    # What one request holds at most at once: its step's tokens plus a window
    # behind them (a whole prompt when nothing chunks), and a page of slack.
    step = need * page_size if chunk is None else max(chunk, config.max_prefill_tokens)
    alone = min(need, -(-(step + window) // page_size) + 2)
    num_swa = 1 + alone + draw(st.integers(0, alone if pressure else 3 * alone))
    return (
        config,
        num_pages,
        arrivals,
        aborts,
        aborted,
        {
            "num_swa_pages": num_swa,
            "swa_window": window,
        },
    )
