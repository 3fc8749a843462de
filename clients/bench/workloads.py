"""The benchmark's workloads: generated-shared-prefix, random, quote, and
JSONL traces (the real-text ones are in text_workloads.py).

Prompts are token ids of the served model's vocabulary, so every driver and
the baseline see exactly the same input. A trace line is a JSON object:

    {"prompt_ids": [1, 2, 3], "output_len": 64, "timestamp": 0.25}

``timestamp`` (seconds from the trace's start, optional) makes the runner
replay the trace at its recorded times unless a rate or a concurrency is
given. ``--save-trace`` writes any workload in this format.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from clients.bench.passages import INSTRUCTIONS, PASSAGES
from clients.bench.records import BenchRequest
from clients.tokenizer_bundle import TokenizerBundle
from clients.workloads import generated_shared_prefix


class WorkloadError(ValueError):
    """A workload that cannot be built or read (the message says why)."""


def shared_prefix_workload(
    vocab: int,
    seed: int = 1,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix workload (DESIGN section 9)."""
    trace = generated_shared_prefix(
        seed, num_groups, prompts_per_group, system_prompt_len, question_len, output_len, vocab
    )
    return [BenchRequest(i, t.prompt_ids, len(t.output_ids), t.group) for i, t in enumerate(trace)]


def random_workload(
    vocab: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 1,
) -> list[BenchRequest]:
    """Independent random prompts; input and output lengths uniform in
    [len * range_ratio, len] (SGLang's random dataset; ratio 1 = fixed)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise WorkloadError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise WorkloadError("--random-input-len and --random-output-len must be at least 1")
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(BenchRequest(i, [rng.randrange(vocab) for _ in range(n_in)], n_out))
    return out


def quote_workload(
    tokenizer: TokenizerBundle, num_prompts: int, output_len: int, seed: int = 1
) -> list[BenchRequest]:
    """Chat prompts that ask the model to repeat a passage (clients/bench/
    passages.py), each passage with each instruction in a seeded order: the
    latency-bound traffic speculative decoding is for (an answer that quotes
    its context)."""
    if output_len < 1:
        raise WorkloadError("--quote-output-len must be at least 1")
    pairs = [(p, i) for p in PASSAGES for i in INSTRUCTIONS]
    random.Random(seed).shuffle(pairs)
    out = []
    for k in range(num_prompts):
        passage, instruction = pairs[k % len(pairs)]
        text = instruction.format(passage=passage)
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.chat_prompt(messages)
        chat = tokenizer.chat_text(messages)
        out.append(BenchRequest(k, ids, output_len, text=text, prompt_text=chat))
    return out


def json_lines(f: Iterable[str], path: str | Path) -> Iterator[tuple[str, object]]:
    """(where, parsed line) for each non-blank line of a JSONL file."""
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not JSON ({e.msg})") from None


def read_trace(path: str | Path, vocab: int | None = None) -> list[BenchRequest]:
    """A JSONL trace; every line is checked (ids within ``vocab`` when known)."""
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for where, item in json_lines(f, path):
            requests.append(_trace_item(item, len(requests), where, vocab))
    if not requests:
        raise WorkloadError(f"{path}: the trace has no requests")
    stamps = [r.arrival_s for r in requests]
    if any(s is not None for s in stamps) and any(s is None for s in stamps):
        raise WorkloadError(f"{path}: either every line has a timestamp or none does")
    return requests


def _trace_item(item: object, index: int, where: str, vocab: int | None) -> BenchRequest:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: a line must be a JSON object")
    ids, out, stamp = item.get("prompt_ids"), item.get("output_len"), item.get("timestamp")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise WorkloadError(f"{where}: prompt_ids must be a non-empty list of integers")
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise WorkloadError(f"{where}: prompt_ids must lie in [0, {vocab})")
    if type(out) is not int or out < 1:
        raise WorkloadError(f"{where}: output_len must be a positive integer")
    if stamp is not None and (not isinstance(stamp, int | float) or stamp < 0):
        raise WorkloadError(f"{where}: timestamp must be a number >= 0")
    group = item.get("group", -1)
    return BenchRequest(index, ids, out, group if type(group) is int else -1, stamp)


def write_trace(path: str | Path, requests: Iterable[BenchRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            item: dict = {"prompt_ids": r.prompt_ids, "output_len": r.output_len}
            if r.group >= 0:
                item["group"] = r.group
            if r.arrival_s is not None:
                item["timestamp"] = r.arrival_s
            f.write(json.dumps(item, separators=(",", ":")) + "\n")
