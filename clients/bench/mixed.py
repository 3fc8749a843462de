"""``--dataset mixed``: steady decoding streams with long prompts arriving
at random (the workload prefill/decode disaggregation is for).

``--mixed-streams`` streams each decode ``--mixed-stream-output`` tokens
(EOS ignored) from a short prompt and start again at once, so that many
stay in flight for ``--mixed-duration`` seconds; meanwhile prompts of
``--mixed-long-len`` tokens of prose arrive as a Poisson process at
``--mixed-long-rate`` per second and ask for ``--mixed-long-output`` tokens.
Every prompt opens with its own id, so no two share a cached prefix and
each run's prompts are fresh.

Reported per class: the streams' ITL p50/p99 and median TPOT, the long
prompts' TTFT p50/p99, all output tokens per second, and the
*interference*: the streams' ITL p50 and p99 during a long prompt's
prefill (gaps that overlap the time from its send to its first token)
against outside every prefill."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

from clients.bench.drivers import Driver
from clients.bench.metrics import percentile
from clients.bench.records import BenchRequest, RequestRecord
from clients.bench.runner import Run, error_text
from clients.tokenizer_bundle import TokenizerBundle


def add_mixed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "mixed (--dataset mixed)",
        "steady decoding streams and long prompts arriving at random (prefill/decode "
        "disaggregation's workload)",
    )
    g.add_argument("--mixed-streams", type=int, default=8, help="decoding streams in flight")
    g.add_argument("--mixed-stream-input", type=int, default=64, help="a stream's prompt tokens")
    g.add_argument("--mixed-stream-output", type=int, default=256, help="a stream's tokens")
    g.add_argument("--mixed-long-rate", type=float, default=0.5, help="long prompts per second")
    g.add_argument("--mixed-long-len", type=int, default=2048, help="a long prompt's tokens")
    g.add_argument("--mixed-long-output", type=int, default=16, help="a long prompt's tokens out")
    g.add_argument("--mixed-duration", type=float, default=60.0, help="seconds of sending")


def check_mixed(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dataset != "mixed":
        return
    for name in ("mixed_streams", "mixed_stream_input", "mixed_stream_output"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("mixed_long_len", "mixed_long_output"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.mixed_long_rate > 0 or not args.mixed_duration > 0:
        p.error("--mixed-long-rate and --mixed-duration must be > 0")
    if args.prompts_only or args.save_prompts or args.save_trace or args.baseline != "none":
        p.error("--dataset mixed builds its prompts as it runs: nothing to save or replay")


def describe_mixed(args: argparse.Namespace) -> str:
    return (
        f"mixed: {args.mixed_streams} streams of {args.mixed_stream_output} tokens "
        f"({args.mixed_stream_input}-token prompts), long prompts of {args.mixed_long_len} "
        f"tokens (out {args.mixed_long_output}) at {args.mixed_long_rate:g}/s, "
        f"{args.mixed_duration:g} s"
    )


class Prompts:
    """Fresh prompts of prose: an id line, then paragraphs until the length."""

    def __init__(self, tokenizer: TokenizerBundle, seed: int) -> None:
        from clients.bench.prose import default_paragraphs

        self._tok = tokenizer
        self._rng = random.Random(seed)
        self._paragraphs = [tokenizer.encode(" " + p) for p in default_paragraphs()]
        self._serial = 0

    def make(self, tokens: int, output: int) -> BenchRequest:
        self._serial += 1
        ids = self._tok.encode(f"Request {self._serial}-{self._rng.randrange(1 << 30)}:")
        while len(ids) < tokens:
            ids += self._rng.choice(self._paragraphs)
        ids = ids[:tokens]
        return BenchRequest(self._serial, ids, output, prompt_text=self._tok.decode(ids))


async def run_mixed(args: argparse.Namespace, driver: Driver) -> Run:
    prompts = Prompts(await driver.tokenizer(), args.seed)
    streams: list[RequestRecord] = []
    longs: list[RequestRecord] = []
    t0 = time.perf_counter()
    end = t0 + args.mixed_duration

    async def send(req: BenchRequest, into: list[RequestRecord]) -> None:
        record = RequestRecord(req.index, len(req.prompt_ids), time.perf_counter() - t0)
        into.append(record)
        try:
            await driver.send(req, record, t0)
        except Exception as e:  # recorded; the run goes on
            record.error = error_text(e)

    async def stream() -> None:
        while time.perf_counter() < end:
            await send(prompts.make(args.mixed_stream_input, args.mixed_stream_output), streams)

    async def arrivals() -> None:
        rng = random.Random(args.seed + 1)
        sent = []
        while True:
            await asyncio.sleep(rng.expovariate(args.mixed_long_rate))
            if time.perf_counter() >= end:
                break
            req = prompts.make(args.mixed_long_len, args.mixed_long_output)
            sent.append(asyncio.create_task(send(req, longs)))
        await asyncio.gather(*sent)

    await asyncio.gather(arrivals(), *(stream() for _ in range(args.mixed_streams)))
    records = streams + longs
    ends = [r.token_times[-1] for r in records if r.token_times]
    run = Run(records, max(ends, default=time.perf_counter() - t0))
    run.extra["mixed"] = mixed_figures(streams, longs, run.duration_s)
    return run


def mixed_figures(
    streams: list[RequestRecord], longs: list[RequestRecord], duration_s: float
) -> dict[str, float]:
    """The per-class figures (milliseconds, tokens/s); NaN where there is none."""
    nan = float("nan")
    ok_streams = [r for r in streams if r.ok]
    ok_longs = [r for r in longs if r.ok]
    itls = [g for r in ok_streams for g in r.itls_s()]
    tpots = [t for r in ok_streams if (t := r.tpot_s) is not None]
    ttfts = [r.ttft_s for r in ok_longs]
    windows = [(r.start_s, r.token_times[0]) for r in ok_longs]
    during, outside = [], []
    for r in ok_streams:
        t = r.token_times
        for a, b in itertools.pairwise(t):
            if b <= a:
                continue
            overlaps = any(a < w1 and b > w0 for w0, w1 in windows)
            (during if overlaps else outside).append(b - a)
    out_tokens = sum(r.output_tokens for r in streams + longs)

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000 if values else nan

    return {
        "stream_itl_p50_ms": ms(itls, 50),
        "stream_itl_p99_ms": ms(itls, 99),
        "stream_tpot_median_ms": statistics.median(tpots) * 1000 if tpots else nan,
        "long_ttft_p50_ms": ms(ttfts, 50),
        "long_ttft_p99_ms": ms(ttfts, 99),
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else nan,
        "itl_during_prefill_p50_ms": ms(during, 50),
        "itl_during_prefill_p99_ms": ms(during, 99),
        "itl_outside_prefill_p50_ms": ms(outside, 50),
        "itl_outside_prefill_p99_ms": ms(outside, 99),
        "streams_completed": len(ok_streams),
        "long_prompts_completed": len(ok_longs),
        "errors": sum(1 for r in streams + longs if not r.ok),
    }


def mixed_line(figures: dict[str, float]) -> str:
    f = figures
    return (
        f"streams: ITL p50 {f['stream_itl_p50_ms']:.1f} ms, p99 {f['stream_itl_p99_ms']:.1f} ms, "
        f"TPOT {f['stream_tpot_median_ms']:.1f} ms; long prompts: TTFT p50 "
        f"{f['long_ttft_p50_ms']:.0f} ms, p99 {f['long_ttft_p99_ms']:.0f} ms; "
        f"{f['output_tok_s']:.1f} out tok/s; ITL p50/p99 during a prefill "
        f"{f['itl_during_prefill_p50_ms']:.1f}/{f['itl_during_prefill_p99_ms']:.1f} ms, "
        f"outside {f['itl_outside_prefill_p50_ms']:.1f}/{f['itl_outside_prefill_p99_ms']:.1f} ms"
    )
