"""radixserve-bench: drive a running server with a workload and report.

    radixserve-bench --address 127.0.0.1:30000 --dataset generated-shared-prefix \
        --max-concurrency 64 --output-json bench.json --plots-dir plots/
    radixserve-bench --backend openai --base-url http://127.0.0.1:8000 --vocab-size 49152 \
        --dataset random --num-prompts 200 --request-rate 4
    radixserve-bench ... --baseline hf     # the same requests through transformers

Prints a table (and with a baseline, radixserve / baseline ratios), writes
the JSON report and PNG plots when asked. Exit status 1 when no request
completed, 2 on bad arguments or workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from pathlib import Path

from clients.bench.drivers import Driver, OpenAIDriver, RadixDriver
from clients.bench.metrics import agreement, summarize
from clients.bench.records import BenchRequest
from clients.bench.report import ratios, save_plots, table
from clients.bench.runner import Run, run_workload
from clients.bench.workloads import (
    WorkloadError,
    quote_workload,
    random_workload,
    read_trace,
    shared_prefix_workload,
    write_trace,
)
from clients.tokenizer_bundle import TokenizerBundle
from observability.logging_setup import configure_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixserve-bench",
        description="Serving benchmark for radixserve (or any OpenAI completions API).",
    )
    s = p.add_argument_group("server")
    s.add_argument("--backend", choices=["radixserve", "openai"], default="radixserve")
    s.add_argument("--address", default="127.0.0.1:30000", help="radixserve gRPC address")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI API base URL")
    s.add_argument("--model", default=None, help="OpenAI model name (default: the first listed)")
    s.add_argument(
        "--tokenizer",
        default="default",
        help="openai backend: the served model ('default', a .gguf file or an HF directory) "
        "whose tokenizer turns the workload's ids into prompt text",
    )
    s.add_argument("--tls", action="store_true")
    s.add_argument("--tls-ca", default=None)
    s.add_argument("--tls-server-name", default=None)
    s.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))

    w = p.add_argument_group("workload")
    w.add_argument(
        "--dataset",
        choices=["generated-shared-prefix", "random", "quote", "trace"],
        default=None,
        help="default: generated-shared-prefix, or trace when --trace is given",
    )
    w.add_argument("--seed", type=int, default=1)
    w.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt ids are drawn below this (default: the server's vocabulary)",
    )
    w.add_argument("--gsp-num-groups", type=int, default=64)
    w.add_argument("--gsp-prompts-per-group", type=int, default=16)
    w.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    w.add_argument("--gsp-question-len", type=int, default=128)
    w.add_argument("--gsp-output-len", type=int, default=256)
    w.add_argument("--num-prompts", type=int, default=1000, help="random dataset size")
    w.add_argument("--random-input-len", type=int, default=1024)
    w.add_argument("--random-output-len", type=int, default=1024)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument(
        "--quote-output-len",
        type=int,
        default=64,
        help="quote dataset: output tokens per request (its prompts ask to repeat a passage; "
        "--num-prompts of them, the tokenizer of --tokenizer)",
    )
    w.add_argument("--trace", default=None, help="JSONL trace to replay")
    w.add_argument("--save-trace", default=None, help="write the workload as a JSONL trace")

    w.add_argument(
        "--flush-cache",
        action="store_true",
        help="radixserve: empty the server's prefix cache before each run, so repeated runs "
        "of one workload (--repeats) start alike",
    )

    a = p.add_argument_group("load")
    a.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals, requests/s (default inf: all at once)",
    )
    a.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    a.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="short unrecorded requests (prompts unrelated to the workload) first",
    )

    b = p.add_argument_group("baseline")
    b.add_argument(
        "--baseline",
        choices=["none", "hf"],
        default="none",
        help="hf: the same requests through transformers generate, in this process",
    )
    b.add_argument(
        "--baseline-model",
        default="default",
        help="what the server serves: 'default', a .gguf file or an HF directory",
    )
    b.add_argument(
        "--baseline-batch-size",
        type=int,
        default=None,
        help="generate batch size (default: --max-concurrency, else 16)",
    )
    b.add_argument("--baseline-device", default="cpu")
    b.add_argument("--baseline-dtype", default="auto")

    c = p.add_argument_group("peer comparison")
    c.add_argument(
        "--compare-openai",
        default=None,
        metavar="URL",
        help="also send the same workload to this OpenAI API (e.g. vLLM's server), "
        "alternating which goes first; ratios are ours / peer of per-figure medians",
    )
    c.add_argument("--compare-model", default=None, help="the peer's model name")
    c.add_argument(
        "--compare-tokenizer",
        default=None,
        help="the peer's model ('default', a .gguf file or an HF directory), for its "
        "tokenizer (default: --tokenizer, else 'default')",
    )
    c.add_argument(
        "--compare-speculative",
        action="store_true",
        help="radixserve: run the workload with speculative decoding off for every request "
        "(custom_params speculative=false) and as the server runs it, alternating; ratios "
        "are speculative / off",
    )
    c.add_argument("--repeats", type=int, default=3, help="runs of each side when comparing")

    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None)
    o.add_argument("--plots-dir", default=None)
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--log-level", default="warning", help="of the messages on stderr")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dataset is None:
        args.dataset = "trace" if args.trace else "generated-shared-prefix"
    if args.dataset == "trace" and not args.trace:
        p.error("--dataset trace needs --trace PATH")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.baseline_batch_size is not None and args.baseline_batch_size < 1:
        p.error("--baseline-batch-size must be at least 1")
    for name in (
        "gsp_num_groups",
        "gsp_prompts_per_group",
        "gsp_system_prompt_len",
        "gsp_question_len",
        "gsp_output_len",
        "num_prompts",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.compare_openai and args.baseline != "none":
        p.error("--compare-openai and --baseline are run one at a time")
    if args.compare_speculative and (args.compare_openai or args.baseline != "none"):
        p.error("--compare-speculative runs alone (not with --compare-openai or --baseline)")
    if args.compare_speculative and args.backend != "radixserve":
        p.error("--compare-speculative needs --backend radixserve")
    if args.quote_output_len < 1:
        p.error("--quote-output-len must be at least 1")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.vocab_size is not None and args.vocab_size < 2:
        p.error("--vocab-size must be at least 2")


def make_driver(args: argparse.Namespace) -> Driver:
    if args.backend == "openai":
        return OpenAIDriver(
            args.base_url, local_tokenizer(args.tokenizer), args.model, args.api_key
        )
    return RadixDriver(
        args.address,
        speculative=getattr(args, "speculative", None),
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
        api_key=args.api_key,
    )


def local_tokenizer(model: str) -> TokenizerBundle:
    from worker_service.weights import open_model  # torch: imported only when needed

    return TokenizerBundle(open_model(model).files.tokenizer_files())


def build_workload(args: argparse.Namespace, vocab: int | None) -> list[BenchRequest]:
    if args.dataset == "trace":
        return read_trace(args.trace, vocab)
    if vocab is None:
        raise WorkloadError("this server does not say its vocabulary size: pass --vocab-size")
    if args.dataset == "quote":
        return quote_workload(
            local_tokenizer(args.tokenizer), args.num_prompts, args.quote_output_len, args.seed
        )
    if args.dataset == "random":
        return random_workload(
            vocab,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    return shared_prefix_workload(
        vocab,
        args.seed,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
    )


async def serve_run(args: argparse.Namespace) -> tuple[list[BenchRequest], Run]:
    driver = make_driver(args)
    try:
        vocab = args.vocab_size or await driver.vocab_size()
        requests = build_workload(args, vocab)
        if args.save_trace:
            write_trace(args.save_trace, requests)
        if args.warmup_requests:
            rng = random.Random(-1)
            warm = [
                BenchRequest(-1 - i, [rng.randrange(vocab or 2) for _ in range(16)], 4)
                for i in range(args.warmup_requests)
            ]
            await run_workload(driver, warm, progress=False)
        if args.flush_cache and isinstance(driver, RadixDriver):
            await driver.flush_cache()
        replay = args.dataset == "trace" and requests[0].arrival_s is not None
        replay = replay and math.isinf(args.request_rate) and args.max_concurrency is None
        run = await run_workload(
            driver,
            requests,
            rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            replay=replay,
            seed=args.seed,
            progress=not args.no_progress,
        )
        return requests, run
    finally:
        await driver.close()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    # Stdout carries the table and the JSON line; the model-loading code's
    # structlog messages would land there too by default.
    configure_logging(args.log_level)
    if args.compare_openai or args.compare_speculative:
        return compare_main(args)
    try:
        requests, run = asyncio.run(serve_run(args))
    except (WorkloadError, OSError) as e:
        print(f"radixserve-bench: {e}", file=sys.stderr)
        return 2
    runs = {args.backend: (run.records, run.duration_s)}
    summaries = {args.backend: summarize(run.records, run.duration_s)}
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "api_key"}}
    if args.baseline == "hf":
        from clients.bench.hf_baseline import run_hf_baseline

        batch = args.baseline_batch_size or args.max_concurrency or 16
        base = run_hf_baseline(
            requests,
            args.baseline_model,
            batch,
            args.baseline_device,
            args.baseline_dtype,
            progress=not args.no_progress,
        )
        runs["hf"] = (base.records, base.duration_s)
        summaries["hf"] = summarize(base.records, base.duration_s)
        report["ratios"] = ratios(summaries[args.backend], summaries["hf"])
        report["agreement"] = agreement(run.records, base.records)
        report["baseline"] = {"batch_size": batch, "device": base.device, "dtype": base.dtype}
    report["results"] = summaries
    print(table(summaries, report.get("ratios")))
    if "agreement" in report:
        a = report["agreement"]
        print(
            f"greedy outputs identical to the baseline's: {a['identical']:.1%} of "
            f"{a['compared']} (first token: {a['same_first_token']:.1%})"
        )
    for name, s in summaries.items():
        for err in s["errors"]:
            print(f"{name} error: {err}", file=sys.stderr)
    if args.plots_dir:
        report["plots"] = [str(x) for x in save_plots(runs, args.plots_dir)]
    if args.output_json:
        Path(args.output_json).write_text(strict_json(report, indent=2))
    last = {"results": summaries, **{k: report[k] for k in ("ratios",) if k in report}}
    print(strict_json(last))
    return 0 if summaries[args.backend]["completed"] else 1


def compare_main(args: argparse.Namespace) -> int:
    """This server against --compare-openai (or itself with speculative
    decoding off: --compare-speculative), alternating, --repeats times."""
    from clients.bench.compare import (
        PEER,
        median_summary,
        ratio_ranges,
        run_alternating,
        speculation_off_args,
    )

    other = speculation_off_args(args) if args.compare_speculative else None
    try:
        sides, last, per_repeat = run_alternating(args, serve_run, summarize, other)
    except (WorkloadError, OSError) as e:
        print(f"radixserve-bench: {e}", file=sys.stderr)
        return 2
    summaries = {name: median_summary(runs) for name, runs in sides.items()}
    report: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "results": summaries,
        "ratios": ratios(summaries[args.backend], summaries[PEER]),
        "ratio_ranges": ratio_ranges(per_repeat),
        "repeats": {name: runs for name, runs in sides.items()},
    }
    what = " (peer: this server, speculative decoding off)" if other is not None else ""
    print(f"medians of {args.repeats} alternating runs each; ratio = {args.backend} / {PEER}{what}")
    print(table(summaries, report["ratios"]))
    if args.plots_dir:
        report["plots"] = [str(x) for x in save_plots(last, args.plots_dir)]
    if args.output_json:
        Path(args.output_json).write_text(strict_json(report, indent=2))
    print(strict_json({k: report[k] for k in ("results", "ratios", "ratio_ranges")}))
    return 0 if all(s["completed"] for s in summaries.values()) else 1


def strict_json(value: object, indent: int | None = None) -> str:
    """JSON that strict readers accept: NaN and infinities become null."""

    def clean(v: object) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), indent=indent, allow_nan=False, default=str)


if __name__ == "__main__":
    sys.exit(main())
