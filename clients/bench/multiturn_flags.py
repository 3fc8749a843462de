"""radixserve-bench's flags for the multi-turn chat workload (``--dataset
multiturn``), their checks, and its description in the report.

Sizing against a server's KV pool: the working set is about
``system + conversations x turns x (question + answer + template)`` tokens
(``--mt-working-set`` computes it exactly, and asks a radixserve server for
its pool: ``max_total_num_tokens``). For a cache that must spill, raise
``--mt-conversations`` until the working set is about 4x the pool."""

from __future__ import annotations

import argparse


def add_multiturn_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "multi-turn chat (--dataset multiturn)",
        "N conversations of K turns, each turn the whole conversation so far (earlier "
        "questions and the server's own answers) and a new question; a closed loop per "
        "conversation with a think time between turns, all conversations at once",
    )
    g.add_argument("--mt-conversations", type=int, default=32, help="conversations (N)")
    g.add_argument("--mt-turns", type=int, default=8, help="turns per conversation (K)")
    g.add_argument(
        "--mt-question-len",
        type=int,
        default=128,
        help="tokens per question at most (a passage of prose and a question about it)",
    )
    g.add_argument("--mt-output-len", type=int, default=128, help="max tokens per answer")
    g.add_argument(
        "--mt-system-prompt-len",
        type=int,
        default=0,
        help="a system prompt of about this many tokens (a document of prose) that every "
        "conversation opens with; 0: none",
    )
    g.add_argument(
        "--mt-unique-system-prompts",
        action="store_true",
        help="each conversation its own system prompt (its own document) instead of one shared",
    )
    g.add_argument(
        "--mt-think-time-s",
        type=float,
        default=1.0,
        help="mean pause between an answer's end and the next question (and before a "
        "conversation's first one)",
    )
    g.add_argument(
        "--mt-think-time-dist",
        choices=["exponential", "fixed"],
        default="exponential",
    )
    g.add_argument(
        "--mt-working-set",
        action="store_true",
        help="print the workload's working set (distinct prefix tokens, answers at full "
        "length), the server's KV pool and their ratio, and exit without sending anything",
    )


def check_multiturn(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dataset != "multiturn":
        if args.mt_working_set:
            p.error("--mt-working-set needs --dataset multiturn")
        return
    for name in ("mt_conversations", "mt_turns", "mt_question_len", "mt_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.mt_system_prompt_len < 0:
        p.error("--mt-system-prompt-len must be >= 0")
    if not args.mt_think_time_s >= 0 or args.mt_think_time_s == float("inf"):
        p.error("--mt-think-time-s must be a number >= 0")
    if args.prompts_only or args.save_prompts or args.save_trace:
        p.error(
            "a multi-turn workload's prompts hold the server's answers: nothing to save "
            "before the run (--mt-working-set sizes it)"
        )
    if args.baseline != "none":
        p.error("--baseline hf does not run conversations")


def describe_multiturn(args: argparse.Namespace) -> str:
    system = "no system prompt"
    if args.mt_system_prompt_len:
        whose = "one per conversation" if args.mt_unique_system_prompts else "shared"
        system = f"a {args.mt_system_prompt_len}-token system prompt, {whose}"
    return (
        f"multiturn: {args.mt_conversations} conversations of {args.mt_turns} turns, "
        f"questions of at most {args.mt_question_len} tokens of prose, answers of at most "
        f"{args.mt_output_len}, {system}, think time {args.mt_think_time_dist} "
        f"mean {args.mt_think_time_s:g} s"
    )
