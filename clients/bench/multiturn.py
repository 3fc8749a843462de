"""``--dataset multiturn`` in a run: the conversations the flags describe,
sent through the conversation runner, and ``--mt-working-set``'s sizing
report (the workload's distinct prefix tokens against the server's KV
pool)."""

from __future__ import annotations

import argparse
import math

from clients.bench.conversation_runner import ThinkTime, run_conversations
from clients.bench.conversations import (
    ChatFormat,
    Conversation,
    ConversationPlan,
    distinct_prefix_tokens,
    plan_conversations,
    planned_sequences,
)
from clients.bench.drivers import Driver, RadixDriver
from clients.bench.flags import sampling_mode
from clients.bench.runner import Run
from clients.bench.workloads import WorkloadError
from clients.tokenizer_bundle import TokenizerBundle


def plans(args: argparse.Namespace, tokenizer: TokenizerBundle) -> list[ConversationPlan]:
    from clients.bench.prose import default_paragraphs, read_paragraphs

    try:
        paragraphs = read_paragraphs(args.text_files) if args.text_files else default_paragraphs()
    except OSError as e:
        raise WorkloadError(f"--text-files: {e}") from None
    return plan_conversations(
        tokenizer,
        paragraphs,
        conversations=args.mt_conversations,
        turns=args.mt_turns,
        question_len=args.mt_question_len,
        output_len=args.mt_output_len,
        system_prompt_len=args.mt_system_prompt_len,
        unique_system_prompts=args.mt_unique_system_prompts,
        seed=args.seed,
    )


async def run_multiturn(args: argparse.Namespace, driver: Driver) -> Run:
    tokenizer = await driver.tokenizer()
    fmt = ChatFormat(tokenizer, chat=not args.skip_chat_template)
    conversations = [Conversation(p, fmt) for p in plans(args, tokenizer)]
    mode = sampling_mode(args)
    run = await run_conversations(
        driver,
        conversations,
        think=ThinkTime(args.mt_think_time_s, args.mt_think_time_dist),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        sampled_seeds=not mode.greedy and mode.request_seeds,
        progress=not args.no_progress,
    )
    pool = await pool_tokens(driver)
    run.extra["device_pool_tokens"] = pool
    ws = run.extra["working_set_tokens"]
    run.extra["working_set_over_pool"] = ws / pool if pool else math.nan
    return run


async def pool_tokens(driver: Driver) -> int | None:
    """The server's KV pool in tokens (radixserve's GetServerInfo), or None."""
    if isinstance(driver, RadixDriver):
        return await driver.pool_tokens()
    return None


async def working_set_report(args: argparse.Namespace, driver: Driver) -> dict:
    """The planned working set and, where the server says, its ratio to the
    pool and the conversations that would make it ``target`` x the pool."""
    tokenizer = await driver.tokenizer()
    fmt = ChatFormat(tokenizer, chat=not args.skip_chat_template)
    sequences = planned_sequences(plans(args, tokenizer), fmt)
    ws = distinct_prefix_tokens(sequences)
    pool = await pool_tokens(driver)
    out: dict = {
        "working_set_tokens": ws,
        "longest_conversation_tokens": max(len(s) for s in sequences),
        "device_pool_tokens": pool,
    }
    if pool:
        out["working_set_over_pool"] = ws / pool
        per_conversation = ws / args.mt_conversations
        out["conversations_for_4x_pool"] = math.ceil(4 * pool / per_conversation)
    return out


def figures_line(extra: dict) -> str:
    """The run's multi-turn figures in words."""
    ratio = extra.get("working_set_over_pool")
    pool = extra.get("device_pool_tokens")
    size = f"working set {extra['working_set_tokens']} tokens"
    if pool:
        size += f" = {ratio:.2f}x the device KV pool ({pool} tokens)"
    return (
        f"turns completed {extra['turns_completed']}/{extra['turns_planned']}, "
        f"conversations completed {extra['conversations_completed']}/{extra['conversations']}, "
        + size
    )
