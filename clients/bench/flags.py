"""radixserve-bench's flags, and the defaults that depend on each other
(the dataset, the sampling and EOS, by what the run compares against).

Comparisons with a peer (--compare-openai) default to the traffic users send:
real text (--dataset text) sampled at temperature 1.0 with a seed per
request, EOS honoured. The earlier greedy random-token comparison is
``--dataset random --temperature 0``; plain runs and the transformers
baseline stay greedy (the baseline compares outputs token by token)."""

from __future__ import annotations

import argparse
import math
import os

from clients.bench.mixed import add_mixed_flags, check_mixed, describe_mixed
from clients.bench.multiturn_flags import add_multiturn_flags, check_multiturn, describe_multiturn
from clients.bench.sampling import SamplingMode

# Datasets whose prompts are words (they need the model's tokenizer); a
# user's chat ends at EOS, so these (and the multi-turn chat) honour it
# unless --ignore-eos.
TEXT_DATASETS = ("text", "jsonl")
CHAT_DATASETS = (*TEXT_DATASETS, "multiturn")
DEFAULT_PROMPTS = {"random": 1000, "text": 256, "quote": 1000}


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
        "whose tokenizer builds the text datasets' prompts and turns token ids into text "
        "(the radixserve backend asks the server for its own)",
    )
    s.add_argument("--tls", action="store_true")
    s.add_argument("--tls-ca", default=None)
    s.add_argument("--tls-server-name", default=None)
    s.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))

    w = p.add_argument_group("workload")
    w.add_argument(
        "--dataset",
        choices=[
            "generated-shared-prefix",
            "random",
            "quote",
            "trace",
            "text",
            "jsonl",
            "multiturn",
            "mixed",
        ],
        default=None,
        help="default: trace when --trace is given, text with --compare-openai, else "
        "generated-shared-prefix (random token ids, like random)",
    )
    w.add_argument(
        "--seed",
        type=int,
        default=1,
        help="picks the prompts, the arrivals and the requests' sampling seeds "
        "(--compare-openai: repeat i uses seed + i)",
    )
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
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="random, quote, text and jsonl dataset size (default: 1000 random or quote, "
        "256 text, every line of a jsonl file)",
    )
    w.add_argument("--random-input-len", type=int, default=1024)
    w.add_argument("--random-output-len", type=int, default=1024)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument(
        "--quote-output-len",
        type=int,
        default=64,
        help="quote dataset: output tokens per request (its prompts ask to repeat a passage; "
        "--num-prompts of them)",
    )
    w.add_argument(
        "--text-files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="text dataset: prose to cut passages from (paragraphs between blank lines; "
        "default: Python's documentation topics, pydoc_data/topics.py)",
    )
    w.add_argument(
        "--text-input-len",
        type=int,
        default=512,
        help="text dataset: prompt tokens at most (chat template and question included)",
    )
    w.add_argument(
        "--text-range-ratio",
        type=float,
        default=0.5,
        help="text dataset: a prompt's budget is uniform in "
        "[text-input-len * ratio, text-input-len]",
    )
    w.add_argument(
        "--text-output-len",
        type=int,
        default=128,
        help="text dataset, and jsonl lines without output_tokens: max output tokens",
    )
    w.add_argument(
        "--text-questions-per-passage",
        type=int,
        default=1,
        help="text dataset: prompts per passage, each with another question (a shared "
        "prefix of real text when above 1)",
    )
    w.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl dataset: one {"prompt": ..., "output_tokens": N (optional)} a line '
        "(vLLM's custom dataset)",
    )
    w.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="text and jsonl datasets: send the message as the prompt, without the chat template",
    )
    w.add_argument(
        "--save-prompts",
        default=None,
        help="write a text workload as vLLM's custom dataset (vllm bench serve "
        "--dataset-name custom --dataset-path FILE sends the same prompts)",
    )
    w.add_argument(
        "--prompts-only",
        action="store_true",
        help="build the workload and write --save-prompts / --save-trace, send nothing "
        "(with --backend openai, a text workload needs no server: --tokenizer's)",
    )
    w.add_argument("--trace", default=None, help="JSONL trace to replay")
    w.add_argument("--save-trace", default=None, help="write the workload as a JSONL trace")

    w.add_argument(
        "--flush-cache",
        action="store_true",
        help="radixserve: empty the server's prefix cache before each run, so repeated runs "
        "of one workload (--repeats) start alike",
    )

    m = p.add_argument_group("sampling")
    m.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0: greedy (default, and what --baseline hf compares); default with "
        "--compare-openai: 1.0, the servers' default sampling",
    )
    m.add_argument("--top-p", type=float, default=1.0)
    m.add_argument("--top-k", type=int, default=-1, help="-1: off")
    m.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="generate every output token past EOS (default: yes for token-id datasets, "
        "no for text, jsonl and multiturn, whose chats end at EOS)",
    )
    m.add_argument(
        "--no-request-seeds",
        action="store_true",
        help="sampled runs: send no seed (each server draws from its own generator) "
        "instead of a distinct seed per request drawn from --seed",
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
        "alternating which goes first, fresh prompts every repeat; ratios are ours / peer "
        "of per-figure medians. Defaults to real text (--dataset text) sampled at "
        "temperature 1.0, a seed per request; the earlier greedy random-token comparison "
        "is --dataset random --temperature 0",
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
    c.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="every repeat sends the same prompts (both servers answer later repeats from "
        "a warm cache) instead of fresh ones (seed + i)",
    )

    add_multiturn_flags(p)
    add_mixed_flags(p)

    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None)
    o.add_argument("--plots-dir", default=None)
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--log-level", default="warning", help="of the messages on stderr")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses what cannot run and fills in the defaults that depend on
    other flags."""
    if args.dataset is None:
        args.dataset = (
            "trace" if args.trace else "text" if args.compare_openai else "generated-shared-prefix"
        )
    if args.dataset == "trace" and not args.trace:
        p.error("--dataset trace needs --trace PATH")
    if args.prompts_only and not (args.save_prompts or args.save_trace):
        p.error("--prompts-only writes --save-prompts or --save-trace: name one")
    if args.dataset == "jsonl" and not args.dataset_path:
        p.error("--dataset jsonl needs --dataset-path FILE")
    if args.num_prompts is None:
        args.num_prompts = DEFAULT_PROMPTS.get(args.dataset, 1 << 30)
    if args.temperature is None:
        args.temperature = 1.0 if args.compare_openai else 0.0
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset not in CHAT_DATASETS
    if args.temperature < 0 or not math.isfinite(args.temperature):
        p.error("--temperature must be a number >= 0")
    if not 0.0 < args.top_p <= 1.0:
        p.error("--top-p must be in (0, 1]")
    if args.top_k == 0 or args.top_k < -1:
        p.error("--top-k must be -1 (off) or at least 1")
    if args.baseline != "none" and (args.temperature > 0 or not args.ignore_eos):
        p.error(
            "--baseline hf compares greedy outputs of full length: --temperature 0 --ignore-eos"
        )
    for name in ("text_input_len", "text_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
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
    check_multiturn(p, args)
    check_mixed(p, args)


def sampling_mode(args: argparse.Namespace) -> SamplingMode:
    return SamplingMode(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        request_seeds=not args.no_request_seeds,
    )


def describe(args: argparse.Namespace) -> str:
    """The workload and the sampling in words, for the report."""
    if args.dataset == "text":
        from clients.bench.prose import DEFAULT_SOURCE

        source = ", ".join(args.text_files) if args.text_files else DEFAULT_SOURCE
        what = (
            f"text: prose of {source}, {args.num_prompts} prompts of at most "
            f"{args.text_input_len} tokens with a question, "
            f"{args.text_questions_per_passage} per passage"
        )
    elif args.dataset == "multiturn":
        what = describe_multiturn(args)
    elif args.dataset == "mixed":
        what = describe_mixed(args)
    elif args.dataset == "jsonl":
        what = f"jsonl: prompts of {args.dataset_path}"
    elif args.dataset in ("random", "generated-shared-prefix", "trace"):
        what = f"{args.dataset}: random token ids" if args.dataset != "trace" else "trace"
    else:
        what = args.dataset
    return f"{what}; {sampling_mode(args).describe()}"
