"""vs_vllm.py's ``--direct-vs-gateway``: the same radixserve measured by
`radixserve-bench` (greedy, EOS ignored) straight to its gRPC port and
through the gateway's /v1/completions, alternating, fresh seeds."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
from pathlib import Path

from vs_vllm_accounting import cpu_seconds, scrape, steps_delta
from vs_vllm_servers import BIN, Server, served_name

FIGURES = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")


def radixserve_bench(
    server: Server, load: str, seed: int, model: str, out: Path, *, gateway: bool, tokenizer: str
) -> dict[str, float]:
    """One radixserve-bench run of ``load`` (greedy, EOS ignored), straight to
    the gRPC port or through the gateway."""
    c = int("".join(ch for ch in load if ch.isdigit()) or 1)
    if load.startswith("shared"):
        w = ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "4"]
        w += ["--gsp-prompts-per-group", str(3 * c // 4), "--gsp-system-prompt-len", "256"]
        w += ["--gsp-question-len", "32", "--gsp-output-len", "64"]
    else:
        w = ["--dataset", "random", "--num-prompts", str(3 * c), "--random-input-len", "384"]
        w += ["--random-output-len", "64", "--random-range-ratio", "1"]
    path = out / f"direct-{load}-{'gateway' if gateway else 'grpc'}-seed{seed}.json"
    cmd = [str(BIN / "radixserve-bench"), *w, "--max-concurrency", str(c), "--seed", str(seed)]
    cmd += ["--tokenizer", tokenizer, "--no-progress", "--output-json", str(path)]
    if gateway:
        cmd += ["--backend", "openai", "--base-url", server.base_url, "--model", served_name(model)]
    else:
        cmd += ["--address", str(server.grpc_address)]
    steps0 = scrape(server) if server.metrics_urls else {}
    cpu0 = cpu_seconds(server)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu_seconds(server).items()}
    cpu["bench-client"] = round(
        (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1
    )
    s = next(iter(json.loads(path.read_text())["results"].values()))
    return {
        "output_tok_s": s["output_tokens_per_s"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "input_tokens": s["input_tokens"],
        "cached_tokens": s["cached_tokens"],
        "steps": steps_delta(steps0, scrape(server)) if server.metrics_urls else {},
        "cpu_s": cpu,
    }


def direct_vs_gateway(args: argparse.Namespace, server: Server, out: Path) -> dict:
    results = {}
    for li, load in enumerate(args.direct_vs_gateway):
        runs: dict[str, list[dict[str, float]]] = {"grpc": [], "gateway": []}
        for i in range(args.runs):
            for j, gw in enumerate((False, True) if i % 2 == 0 else (True, False)):
                seed = args.seed + 5000 + 100 * li + 2 * i + j
                r = radixserve_bench(
                    server,
                    load,
                    seed,
                    args.model,
                    out,
                    gateway=gw,
                    tokenizer=args.tokenizer or args.model,
                )
                runs["gateway" if gw else "grpc"].append(r)
                print(f"direct {load} run {i} {'gateway' if gw else 'grpc'}: {r}", flush=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in FIGURES} for k, v in runs.items()}
        ratio = {f: med["gateway"][f] / med["grpc"][f] for f in FIGURES}
        print(f"\n== {load}: through the gateway / straight to gRPC (radixserve-bench, greedy)")
        for f in FIGURES:
            print(f"{f:<14}{med['grpc'][f]:>10.1f}{med['gateway'][f]:>10.1f}{ratio[f]:>8.2f}x")
        results[load] = {"runs": runs, "median": med, "gateway_over_grpc": ratio}
    return results
