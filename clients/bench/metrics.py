"""From per-request records to the report's figures."""

from __future__ import annotations

import math
from collections.abc import Sequence

from clients.bench.records import RequestRecord

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{q}": percentile(ms, q) for q in QUANTILES})
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """Throughputs over the run's duration, latency distributions over the
    completed requests, and the cache hit rate (cached / prompt tokens)."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    itls = [g for r in done for g in r.itls_s()]
    drafted = sum(r.spec_draft_tokens for r in done)
    accepted = sum(r.spec_accepted_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "input_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        # What the server computed of the prompts (the rest it read from its cache).
        "prefill_tokens": prompt - cached,
        "input_tokens_per_s": per_s(prompt),
        "output_tokens_per_s": per_s(output),
        "total_tokens_per_s": per_s(prompt + output),
        "cache_hit_rate": cached / prompt if prompt else math.nan,
        "mean_concurrency": per_s(sum(r.e2e_s for r in done)),
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else math.nan,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms(itls),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def throughput_over_time(
    records: Sequence[RequestRecord], duration_s: float, bins: int = 60
) -> tuple[list[float], list[float]]:
    """Output tokens/s in ``bins`` equal windows of the run: (window ends, rates)."""
    width = max(duration_s, 1e-9) / bins
    counts = [0] * bins
    for r in records:
        for t in r.token_times:
            counts[min(int(t / width), bins - 1)] += 1
    return [width * (i + 1) for i in range(bins)], [c / width for c in counts]


def agreement(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> dict[str, float]:
    """How many requests got the same output ids from two runs (greedy both):
    the share of identical outputs and of identical first tokens."""
    pairs = [
        (x.output_ids, y.output_ids)
        for x, y in zip(a, b, strict=True)
        if x.ok and y.ok and x.output_ids and y.output_ids
    ]
    if not pairs:
        return {"compared": 0, "identical": math.nan, "same_first_token": math.nan}
    return {
        "compared": len(pairs),
        "identical": sum(x == y for x, y in pairs) / len(pairs),
        "same_first_token": sum(x[0] == y[0] for x, y in pairs) / len(pairs),
    }
