"""The host KV tier (issue 34, SGLang's HiCache) measured: radixserve-bench's
multi-turn chat workload against `radixserve serve` with the hierarchical
cache off and on, the same binary, alternating (a program, not a test).

Every run starts a fresh unit (an empty cache; vs_vllm_servers.radixserve,
the gateway beside it unused) with ``--serve-args``, plus ``--on-args`` on
the "on" side (the tier's flags, e.g. ``--enable-hierarchical-cache
--hicache-ratio 4``), and runs `radixserve-bench --dataset multiturn`
straight to its gRPC port: greedy, EOS ignored unless ``--honour-eos`` (so
every answer has its full length and both sides build the same working
set). Repeat i sends the prompts of seed ``--seed + i`` to both sides (fresh
prompts every repeat); which side goes first alternates.

Figures, per side the median over the repeats, and on / off ratios of the
medians with the per-repeat ranges: prefill tokens computed (prompt tokens
less the server's ``cached_tokens``), cache hit rate (cached / prompt
tokens), TTFT p50 and p99, output tokens/s, turns completed. The issue's aim:
prefill tokens at most 0.5x, TTFT p50 at most 0.6x, output tokens/s at
least 1.0x. The last line is JSON.

Sizing: the working set (distinct prefix tokens of all conversations) should
be about 4x the device KV pool, which ``--kv-memory`` in ``--serve-args``
sets. ``--target-ratio R`` asks the first unit for its pool
(`radixserve-bench --mt-working-set`) and sets the conversations so that the
working set is about R x the pool; without it ``--conversations`` is used
and the ratio is printed.

    python benchmarks/hicache_multiturn.py --repeats 3 --target-ratio 4 \\
        --serve-args="--kv-memory 256MiB" \\
        --on-args="--enable-hierarchical-cache --hicache-ratio 4" \\
        --bench-args="--mt-turns 6 --mt-question-len 192 --mt-output-len 64 \\
                      --mt-system-prompt-len 512 --mt-think-time-s 0.5"
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vs_vllm_servers import BIN, radixserve

SIDES = ("off", "on")
# (name, key path in radixserve-bench's summary)
FIGURES: dict[str, tuple[str, ...]] = {
    "prefill_tokens": ("prefill_tokens",),
    "cache_hit_rate": ("cache_hit_rate",),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "output_tok_s": ("output_tokens_per_s",),
    "turns_completed": ("turns_completed",),
    "working_set_over_pool": ("working_set_over_pool",),
}
# The issue's aims, on / off: (figure, bound, "<=" or ">=").
AIMS = (("prefill_tokens", 0.5, "<="), ("ttft_p50_ms", 0.6, "<="), ("output_tok_s", 1.0, ">="))


def bench_cmd(args: argparse.Namespace, address: str, conversations: int, seed: int) -> list[str]:
    cmd = [str(BIN / "radixserve-bench"), "--address", address, "--dataset", "multiturn"]
    cmd += ["--mt-conversations", str(conversations), "--seed", str(seed), "--no-progress"]
    if not args.honour_eos:
        cmd.append("--ignore-eos")
    return cmd + shlex.split(args.bench_args)


def size_conversations(args: argparse.Namespace, address: str) -> int:
    """The conversations that make the working set about --target-ratio x the pool."""
    cmd = bench_cmd(args, address, args.conversations, args.seed) + ["--mt-working-set"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    size = json.loads(out.strip().splitlines()[-1])
    pool = size.get("device_pool_tokens")
    if not pool:
        raise SystemExit("the server does not say its KV pool: pass --conversations")
    per_conversation = size["working_set_tokens"] / args.conversations
    n = max(1, math.ceil(args.target_ratio * pool / per_conversation))
    print(
        f"pool {pool} tokens, about {per_conversation:.0f} tokens per conversation: "
        f"{n} conversations for {args.target_ratio:g}x the pool",
        flush=True,
    )
    return n


def one_run(
    args: argparse.Namespace, side: str, conversations: int, seed: int, out: Path
) -> dict[str, float]:
    """A fresh unit with the side's flags, one bench run; its figures."""
    extra = shlex.split(args.serve_args) + (shlex.split(args.on_args) if side == "on" else [])
    tmp = out / f"{side}-seed{seed}"
    tmp.mkdir(parents=True, exist_ok=True)
    with radixserve(args.model, extra, tmp) as server:
        assert server.grpc_address is not None
        path = tmp / "bench.json"
        cmd = bench_cmd(args, server.grpc_address, conversations, seed)
        subprocess.run([*cmd, "--output-json", str(path)], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(path.read_text())["results"]["radixserve"]
    figures = {}
    for name, keys in FIGURES.items():
        value = summary
        for k in keys:
            value = value[k]
        figures[name] = math.nan if value is None else float(value)
    return figures


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def report(runs: dict[str, list[dict[str, float]]]) -> dict:
    med = {s: {f: median([r[f] for r in runs[s]]) for f in FIGURES} for s in SIDES}
    ratio = {f: med["on"][f] / med["off"][f] if med["off"][f] else math.nan for f in FIGURES}
    ranges = {}
    for f in FIGURES:
        per = [on[f] / off[f] for on, off in zip(runs["on"], runs["off"], strict=True) if off[f]]
        ranges[f] = [min(per), max(per)] if per else [math.nan, math.nan]
    print(f"\nmedians of {len(runs['off'])} runs per side; ratio = on / off")
    print(f"{'figure':<24}{'off':>12}{'on':>12}{'ratio':>9}  per-repeat ratio range")
    for f in FIGURES:
        lo, hi = ranges[f]
        print(
            f"{f:<24}{med['off'][f]:>12.3f}{med['on'][f]:>12.3f}{ratio[f]:>8.2f}x"
            f"  {lo:.2f}..{hi:.2f}"
        )
    aims = {}
    for f, bound, op in AIMS:
        met = ratio[f] <= bound if op == "<=" else ratio[f] >= bound
        aims[f] = {"ratio": ratio[f], "aim": f"{op} {bound}", "met": bool(met)}
        print(f"aim {f} on/off {op} {bound}: {'met' if met else 'not met'} ({ratio[f]:.2f}x)")
    return {"median": med, "ratio": ratio, "ratio_range": ranges, "aims": aims}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="what `radixserve serve` loads")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating")
    p.add_argument("--seed", type=int, default=1, help="repeat i uses seed + i")
    p.add_argument("--serve-args", default="", help="`radixserve serve` flags of both sides")
    p.add_argument(
        "--on-args",
        default="--enable-hierarchical-cache",
        help="the flags that turn the host tier on (the 'on' side only)",
    )
    p.add_argument("--bench-args", default="", help="more radixserve-bench flags (--mt-...)")
    p.add_argument("--conversations", type=int, default=32, help="--mt-conversations")
    p.add_argument(
        "--target-ratio",
        type=float,
        default=None,
        help="set the conversations for a working set of this many times the device pool",
    )
    p.add_argument("--honour-eos", action="store_true", help="answers may end early at EOS")
    p.add_argument("--out", help="where results and logs go (default: a new temp dir)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.conversations < 1:
        p.error("--repeats and --conversations must be at least 1")
    out = Path(args.out or tempfile.mkdtemp(prefix="hicache-multiturn-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results and logs in {out}", flush=True)
    conversations = args.conversations
    if args.target_ratio is not None:
        probe = out / "sizing"
        probe.mkdir(exist_ok=True)
        with radixserve(args.model, shlex.split(args.serve_args), probe) as server:
            assert server.grpc_address is not None
            conversations = size_conversations(args, server.grpc_address)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for i in range(args.repeats):
        seed = args.seed + i
        for side in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
            figures = one_run(args, side, conversations, seed, out)
            runs[side].append(figures)
            print(f"repeat {i + 1} {side} (seed {seed}): {json.dumps(figures)}", flush=True)
    result = report(runs)
    result |= {"conversations": conversations, "runs": runs, "config": vars(args)}
    (out / "report.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
