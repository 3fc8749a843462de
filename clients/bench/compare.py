"""--compare-openai: the same workload against this server and a peer's
OpenAI completions endpoint (e.g. vLLM's own server), alternating which goes
first, ``--repeats`` times (--compare-speculative: the peer is this server
with speculative decoding turned off per request); the report quotes each
side's per-figure medians and ours / peer ratios of the medians (these
machines are shared and noisy: one run each would measure the neighbours).

Repeat i sends the workload of seed ``--seed + i`` to both sides: fresh
prompts (and sampling seeds) every repeat, so no repeat is answered from
what an earlier one left in a prefix cache (or drafted from its cached
answers); ``--repeat-prompts`` sends the same prompts every time."""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import statistics
from collections.abc import Mapping, Sequence

from clients.bench.records import RequestRecord
from clients.bench.report import RATIOS, ratios

PEER = "peer"


def peer_args(args: argparse.Namespace) -> argparse.Namespace:
    """The same workload, sent to the peer's OpenAI endpoint."""
    peer = copy.copy(args)
    peer.backend = "openai"
    peer.base_url = args.compare_openai
    peer.model = args.compare_model
    peer.tokenizer = args.compare_tokenizer or args.tokenizer or "default"
    peer.api_key = None
    peer.save_trace = None
    return peer


def speculation_off_args(args: argparse.Namespace) -> argparse.Namespace:
    """The same workload to the same server, every request with custom_params
    speculative=false."""
    off = copy.copy(args)
    off.speculative = False
    off.save_trace = None
    return off


def repeat_args(args: argparse.Namespace, i: int) -> argparse.Namespace:
    """Repeat ``i``'s arguments: seed + i (the same seed with --repeat-prompts)."""
    if args.repeat_prompts or i == 0:
        return args
    fresh = copy.copy(args)
    fresh.seed = args.seed + i
    return fresh


def median_summary(summaries: Sequence[Mapping]) -> dict:
    """Per-figure medians of several runs' summaries (errors: all of them)."""
    first = summaries[0]
    out: dict = {}
    for key, value in first.items():
        values = [s[key] for s in summaries]
        if isinstance(value, Mapping):
            out[key] = median_summary(values)
        elif isinstance(value, list):
            out[key] = sorted({x for v in values for x in v})[:10]
        else:
            finite = [float(v) for v in values if not math.isnan(float(v))]
            out[key] = statistics.median(finite) if finite else math.nan
    return out


def run_alternating(
    args: argparse.Namespace, serve_run, summarize, peer: argparse.Namespace | None = None
) -> tuple[dict[str, list[dict]], dict[str, tuple[list[RequestRecord], float]], list[dict]]:
    """(summaries per side, the last run of each side, ratios per repeat);
    the peer side runs ``peer`` (default: --compare-openai's endpoint)."""
    sides = {args.backend: args, PEER: peer if peer is not None else peer_args(args)}
    summaries: dict[str, list[dict]] = {name: [] for name in sides}
    last: dict[str, tuple[list[RequestRecord], float]] = {}
    per_repeat: list[dict] = []
    for i in range(args.repeats):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        got = {}
        for name in order:
            _, run = asyncio.run(serve_run(repeat_args(sides[name], i)))
            got[name] = summarize(run.records, run.duration_s) | run.extra
            summaries[name].append(got[name])
            last[name] = (run.records, run.duration_s)
        per_repeat.append(ratios(got[args.backend], got[PEER]))
        print(
            f"repeat {i + 1}/{args.repeats} ({' then '.join(order)}): "
            + ", ".join(f"{k} {v:.3f}" for k, v in per_repeat[-1].items()),
            flush=True,
        )
    return summaries, last, per_repeat


def ratio_ranges(per_repeat: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    return {k: [min(r[k] for r in per_repeat), max(r[k] for r in per_repeat)] for k in RATIOS}


__all__ = [
    "PEER",
    "median_summary",
    "peer_args",
    "ratio_ranges",
    "repeat_args",
    "run_alternating",
    "speculation_off_args",
]
