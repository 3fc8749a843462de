"""Prefill/decode disaggregation against co-location, on one machine, with
the default model behind the SMG gateway: steady decoding streams and long
prompts arriving at random (radixserve-bench --dataset mixed, sampled at
temperature 1, EOS ignored, fresh prompts of prose per run).

- co-located: two units (`radixserve serve`), the gateway over both
  (`--worker-urls`, its default cache-aware policy);
- disaggregated: a prefill unit and a decode unit, the gateway in PD mode
  (`--pd-disaggregation --prefill grpc://P BOOTSTRAP --decode grpc://D`).

Each unit's worker gets ``--worker-threads`` threads (1 by default), so
both set-ups run two worker processes on the same cores. The two set-ups
alternate, ``--repeats`` times, each run against freshly started units;
the table gives each figure's median over the repeats and the ratio
disaggregated / co-located.

Interference: the streams' inter-token gaps (p50, p99) while a long
prompt is being prefilled (gaps overlapping some long prompt's time from
send to first token) against outside every prefill. Co-located, a long prompt's
prefill runs in the same steps as the streams of its unit; disaggregated,
the decode unit never prefills, so what is left is the two processes
sharing the machine's cores (on a 2-core CPU the prefill still takes CPU
from the decode worker; on GPUs each side has its own).

Run: python benchmarks/pd_mixed.py [--repeats 3] [--duration 60]
     [--streams 8] [--long-rate 0.5] [--long-len 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.overlap import BIN, free_port, started

FIGURES = (
    ("stream_itl_p50_ms", "streams' ITL p50 (ms)"),
    ("stream_itl_p99_ms", "streams' ITL p99 (ms)"),
    ("stream_tpot_median_ms", "streams' TPOT median (ms)"),
    ("long_ttft_p50_ms", "long prompts' TTFT p50 (ms)"),
    ("long_ttft_p99_ms", "long prompts' TTFT p99 (ms)"),
    ("output_tok_s", "output tok/s"),
    ("itl_during_prefill_p50_ms", "ITL p50 during a prefill (ms)"),
    ("itl_during_prefill_p99_ms", "ITL p99 during a prefill (ms)"),
    ("itl_outside_prefill_p50_ms", "ITL p50 outside prefills (ms)"),
    ("itl_outside_prefill_p99_ms", "ITL p99 outside prefills (ms)"),
    ("long_prompts_completed", "long prompts completed"),
    ("errors", "errors"),
)


def unit(stack: ExitStack, tmp: Path, name: str, threads: int, *extra: str) -> str:
    args = [str(BIN / "radixserve"), "serve", "--worker-threads", str(threads)]
    args += ["--log-level", "warning", *extra]
    port = stack.enter_context(started(args, tmp, name))
    return f"127.0.0.1:{port}"


@contextmanager
def gateway(tmp: Path, worker_args: list[str]):
    port = free_port()
    log = open(tmp / "smg.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        + ["--prometheus-port", str(free_port()), *worker_args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if json.loads(r.read()).get("data"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not start: {(tmp / 'smg.log').read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def bench(base: str, args: argparse.Namespace, seed: int) -> dict:
    cmd = [str(BIN / "radixserve-bench"), "--backend", "openai", "--base-url", base]
    cmd += ["--tokenizer", "default", "--dataset", "mixed", "--temperature", "1.0"]
    cmd += ["--seed", str(seed), "--no-progress", "--warmup-requests", "2"]
    cmd += ["--mixed-streams", str(args.streams), "--mixed-long-rate", str(args.long_rate)]
    cmd += ["--mixed-long-len", str(args.long_len), "--mixed-duration", str(args.duration)]
    cmd += ["--mixed-stream-output", str(args.stream_output)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 4 + 300)
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"results"')]
    if out.returncode or not lines:
        raise RuntimeError(f"radixserve-bench failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1])["results"]["openai"]
    return result["mixed"] | {"first_error": (result["errors"] or [""])[0]}


def colocated(args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        d = Path(tmp)
        a = unit(stack, d, "unit-a", args.worker_threads)
        b = unit(stack, d, "unit-b", args.worker_threads)
        urls = ["--worker-urls", f"grpc://{a}", f"grpc://{b}"]
        with gateway(d, urls) as base:
            return bench(base, args, seed)


def disaggregated(args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        d = Path(tmp)
        bport = free_port()
        p = unit(
            stack,
            d,
            "prefill",
            args.prefill_threads or args.worker_threads,
            *("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport)),
        )
        shm = ("--kv-shared-memory",) if args.shared_memory else ()
        dec = unit(stack, d, "decode", args.worker_threads, "--disaggregation-mode", "decode", *shm)
        pd = ["--pd-disaggregation", "--prefill", f"grpc://{p}", str(bport)]
        pd += ["--decode", f"grpc://{dec}"]
        with gateway(d, pd) as base:
            return bench(base, args, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-output", type=int, default=256)
    ap.add_argument("--long-rate", type=float, default=0.5)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--worker-threads", type=int, default=1, help="each co-located unit's")
    ap.add_argument("--prefill-threads", type=int, default=None, help="default: --worker-threads")
    ap.add_argument("--decode-threads", type=int, default=None, help="default: --worker-threads")
    ap.add_argument(
        "--shared-memory",
        action="store_true",
        help="the decode unit's workers take the KV through /dev/shm (--kv-shared-memory)",
    )
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"co-located": [], "disaggregated": []}
    for i in range(args.repeats):
        for name, run in (("co-located", colocated), ("disaggregated", disaggregated)):
            figures = run(args, seed=1000 + i)
            runs[name].append(figures)
            print(f"repeat {i + 1} {name}: " + json.dumps(figures), flush=True)
    print(
        f"\n{args.streams} streams of {args.stream_output} tokens, long prompts of "
        f"{args.long_len} tokens at {args.long_rate:g}/s, {args.duration:g} s, "
        f"{args.repeats} repeats (medians), worker threads: co-located "
        f"{args.worker_threads} each, prefill {args.prefill_threads or args.worker_threads}, "
        f"decode {args.decode_threads or args.worker_threads}"
    )
    print(f"{'figure':<32} {'co-located':>11} {'disaggregated':>14} {'ratio':>7}")
    for key, label in FIGURES:
        co = statistics.median(r[key] for r in runs["co-located"])
        dis = statistics.median(r[key] for r in runs["disaggregated"])
        ratio = dis / co if co else float("nan")
        print(f"{label:<32} {co:>11.1f} {dis:>14.1f} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
