"""radixserve-bench: drive a running server with a workload and report.

    radixserve-bench --address 127.0.0.1:30000 --dataset generated-shared-prefix \
        --max-concurrency 64 --output-json bench.json --plots-dir plots/
    radixserve-bench --backend openai --base-url http://127.0.0.1:8000 --vocab-size 49152 \
        --dataset random --num-prompts 200 --request-rate 4
    radixserve-bench ... --baseline hf     # the same requests through transformers
    radixserve-bench --address 127.0.0.1:30000 --compare-openai http://127.0.0.1:8100 \
        --compare-tokenizer MODEL_DIR --max-concurrency 16   # sampled real text, vs vLLM

Prints a table (and with a baseline, radixserve / baseline ratios), writes
the JSON report and PNG plots when asked. Exit status 1 when no request
completed, 2 on bad arguments or workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path

from clients.bench.drivers import Driver, OpenAIDriver, RadixDriver
from clients.bench.flags import TEXT_DATASETS, build_parser, check_args, describe, sampling_mode
from clients.bench.metrics import agreement, summarize
from clients.bench.records import BenchRequest
from clients.bench.report import ratios, save_plots, table
from clients.bench.runner import Run, run_workload
from clients.bench.sampling import with_seeds
from clients.bench.text_workloads import jsonl_workload, text_workload, write_prompts
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


def make_driver(args: argparse.Namespace) -> Driver:
    if args.backend == "openai":
        return OpenAIDriver(
            args.base_url,
            local_tokenizer(args.tokenizer),
            args.model,
            args.api_key,
            sampling=sampling_mode(args),
        )
    return RadixDriver(
        args.address,
        speculative=getattr(args, "speculative", None),
        sampling=sampling_mode(args),
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
        api_key=args.api_key,
    )


def local_tokenizer(model: str) -> TokenizerBundle:
    from worker_service.weights import open_model  # torch: imported only when needed

    return TokenizerBundle(open_model(model).files.tokenizer_files())


def build_workload(
    args: argparse.Namespace, vocab: int | None, tokenizer: TokenizerBundle | None = None
) -> list[BenchRequest]:
    """``tokenizer`` (the served model's) for the datasets of words."""
    if args.dataset == "trace":
        return read_trace(args.trace, vocab)
    if args.dataset in (*TEXT_DATASETS, "quote"):
        assert tokenizer is not None
        return text_dataset(args, tokenizer)
    if vocab is None:
        raise WorkloadError("this server does not say its vocabulary size: pass --vocab-size")
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


def text_dataset(args: argparse.Namespace, tokenizer: TokenizerBundle) -> list[BenchRequest]:
    chat = not args.skip_chat_template
    if args.dataset == "quote":
        return quote_workload(tokenizer, args.num_prompts, args.quote_output_len, args.seed)
    if args.dataset == "jsonl":
        return jsonl_workload(
            tokenizer,
            args.dataset_path,
            args.num_prompts,
            args.text_output_len,
            seed=args.seed,
            chat=chat,
        )
    from clients.bench.prose import default_paragraphs, read_paragraphs

    try:
        paragraphs = read_paragraphs(args.text_files) if args.text_files else default_paragraphs()
    except OSError as e:
        raise WorkloadError(f"--text-files: {e}") from None
    return text_workload(
        tokenizer,
        paragraphs,
        args.num_prompts,
        args.text_input_len,
        output_len=args.text_output_len,
        range_ratio=args.text_range_ratio,
        questions_per_passage=args.text_questions_per_passage,
        seed=args.seed,
        chat=chat,
    )


async def prepare(
    args: argparse.Namespace, driver: Driver, vocab: int | None
) -> list[BenchRequest]:
    """The run's requests, with their seeds, saved where asked."""
    words = args.dataset in (*TEXT_DATASETS, "quote")
    tokenizer = await driver.tokenizer() if words else None
    requests = with_seeds(build_workload(args, vocab, tokenizer), sampling_mode(args), args.seed)
    if args.save_trace:
        write_trace(args.save_trace, requests)
    if args.save_prompts:
        write_prompts(args.save_prompts, requests)
    return requests


async def prompts_only(args: argparse.Namespace) -> list[BenchRequest]:
    """--prompts-only: build and save the workload, send nothing (the text
    datasets need only a tokenizer: the server's, or --tokenizer's for
    --backend openai)."""
    driver = make_driver(args)
    try:
        return await prepare(args, driver, args.vocab_size)
    finally:
        await driver.close()


async def serve_run(args: argparse.Namespace) -> tuple[list[BenchRequest], Run]:
    """The workload through a driver; a multi-turn run's requests are built
    as it goes (none returned)."""
    driver = make_driver(args)
    try:
        vocab = args.vocab_size or await driver.vocab_size()
        multiturn = args.dataset == "multiturn"
        mixed = args.dataset == "mixed"
        requests = [] if multiturn or mixed else await prepare(args, driver, vocab)
        if args.warmup_requests:
            rng = random.Random(-1)
            warm = [
                BenchRequest(-1 - i, [rng.randrange(vocab or 2) for _ in range(16)], 4)
                for i in range(args.warmup_requests)
            ]
            await run_workload(driver, warm, progress=False)
        if args.flush_cache and isinstance(driver, RadixDriver):
            await driver.flush_cache()
        if multiturn:
            from clients.bench.multiturn import run_multiturn

            return requests, await run_multiturn(args, driver)
        if mixed:
            from clients.bench.mixed import run_mixed

            return requests, await run_mixed(args, driver)
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
    if args.prompts_only:
        try:
            requests = asyncio.run(prompts_only(args))
        except (WorkloadError, OSError) as e:
            print(f"radixserve-bench: {e}", file=sys.stderr)
            return 2
        tokens = sum(len(r.prompt_ids) for r in requests)
        print(f"{len(requests)} prompts, {tokens} prompt tokens; {describe(args)}")
        return 0
    if args.mt_working_set:
        return working_set_main(args)
    if args.compare_openai or args.compare_speculative:
        return compare_main(args)
    try:
        requests, run = asyncio.run(serve_run(args))
    except (WorkloadError, OSError) as e:
        print(f"radixserve-bench: {e}", file=sys.stderr)
        return 2
    runs = {args.backend: (run.records, run.duration_s)}
    summaries = {args.backend: summarize(run.records, run.duration_s) | run.extra}
    report: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "workload": describe(args),
    }
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
    print(f"workload: {report['workload']}")
    if "mixed" in run.extra:
        from clients.bench.mixed import mixed_line

        print(mixed_line(run.extra["mixed"]))
    elif run.extra:
        from clients.bench.multiturn import figures_line

        print(figures_line(run.extra))
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


def working_set_main(args: argparse.Namespace) -> int:
    """--mt-working-set: the multi-turn workload's size against the server's pool."""
    from clients.bench.multiturn import working_set_report

    async def report() -> dict:
        driver = make_driver(args)
        try:
            return await working_set_report(args, driver)
        finally:
            await driver.close()

    try:
        size = asyncio.run(report())
    except (WorkloadError, OSError) as e:
        print(f"radixserve-bench: {e}", file=sys.stderr)
        return 2
    line = f"working set: {size['working_set_tokens']} distinct prefix tokens"
    if size.get("device_pool_tokens"):
        line += (
            f"; device KV pool: {size['device_pool_tokens']} tokens; ratio "
            f"{size['working_set_over_pool']:.2f}x; about 4x the pool: --mt-conversations "
            f"{size['conversations_for_4x_pool']}"
        )
    print(f"{line}; {describe(args)}")
    pool, longest = size.get("device_pool_tokens"), size["longest_conversation_tokens"]
    if pool and longest > pool:
        print(
            f"a whole conversation ({longest} tokens) does not fit the pool: its last turns "
            "will be refused (fewer turns, shorter questions or answers, or a larger pool)",
            file=sys.stderr,
        )
    print(strict_json(size))
    return 0


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
        "workload": describe(args),
        "seeds": [args.seed + (0 if args.repeat_prompts else i) for i in range(args.repeats)],
        "results": summaries,
        "ratios": ratios(summaries[args.backend], summaries[PEER]),
        "ratio_ranges": ratio_ranges(per_repeat),
        "repeats": {name: runs for name, runs in sides.items()},
    }
    what = " (peer: this server, speculative decoding off)" if other is not None else ""
    print(f"medians of {args.repeats} alternating runs each; ratio = {args.backend} / {PEER}{what}")
    print(table(summaries, report["ratios"]))
    print(f"workload: {report['workload']}; seeds {report['seeds']}")
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
